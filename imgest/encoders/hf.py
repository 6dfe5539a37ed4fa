"""Hugging Face transformers encoders: CLIP and SigLIP (image and text towers), DINOv2 (image)."""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
from collections.abc import Sequence

import numpy as np

from imgest.encoders.base import EncoderError, EncoderSpec, file_digest, l2_normalise
from imgest.encoders.graph_encoder import GraphEncoder, torch_module
from imgest.encoders.graphs import Graph
from imgest.encoders.precision import default_precision
from imgest.encoders.text import is_sentence_transformer, text_spec
from imgest.images import tensors

PREFIX = "hf:"
# model_type -> (modalities, how to read the embedding dimension from config.json)
SUPPORTED = {
    "clip": (("image", "text"), lambda c: c["projection_dim"]),
    "siglip": (("image", "text"), lambda c: c["vision_config"]["hidden_size"]),
    "dinov2": (("image",), lambda c: c["hidden_size"]),
}
_WEIGHT_FILES = (".safetensors", ".bin", ".json", ".txt", ".model")
# model_type -> what its tokenizer imports beyond imgest's own dependencies: transformers 5 tokenizes SigLIP with
# SiglipTokenizer only, a SentencePiece model that it reads with protobuf. The `hf` extra installs them.
TOKENIZER_PACKAGES = {"siglip": ("sentencepiece", "google.protobuf")}
HF_EXTRA = "pip install 'imgest[hf]'"
# transformers 5 resizes with torchvision where it is installed (imgest[gpu]) and with Pillow elsewhere, and the two
# give different pixels: one backend everywhere, so a GPU node and a CPU node make the same vectors
PROCESSOR_BACKEND = "pil"


def _folder_digest(folder: str) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and name.endswith(_WEIGHT_FILES) and not name.startswith("."):
            h.update(name.encode())
            h.update(file_digest(path).encode())
    return h.hexdigest()


def _fetch(repo_id: str, revision: str | None) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, revision=revision,
                                 allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])
    except Exception as exc:
        raise EncoderError(
            f"cannot fetch {repo_id!r} from the Hugging Face hub ({type(exc).__name__}: {exc}); "
            "download it beforehand (HF_HUB_OFFLINE=1 then reads the cache) or pass hf:<local folder>"
        ) from exc


def cached(repo_id: str, revision: str | None, where: str) -> str:
    """The local snapshot of a hub model, or EncoderError: a record may name only what is already here."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, revision=revision, local_files_only=True,
                                 allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])
    except Exception as exc:
        raise EncoderError(f"{where}: hf:{repo_id} is not in this machine's Hugging Face cache, and a store record "
                           "never makes imgest download a model: name it on the command line to fetch it") from exc


def resolve(name: str) -> EncoderSpec:
    target = name[len(PREFIX):]
    if not target:
        raise EncoderError("hf: needs a hub id or a local folder, e.g. hf:openai/clip-vit-base-patch32")
    if os.path.isdir(target):
        folder = os.path.abspath(target)
        revision = _folder_digest(folder)
        source = folder
    else:
        repo_id, _, rev = target.partition("@")
        folder = _fetch(repo_id, rev or None)
        revision = os.path.basename(folder.rstrip("/"))  # the snapshot folder is the commit hash
        source = folder
    if is_sentence_transformer(folder):  # a text model for catalogue captions (imgest/encoders/text.py)
        return text_spec(name if not os.path.isdir(target) else f"{PREFIX}{folder}", folder, revision, "st")
    config_path = os.path.join(folder, "config.json")
    if not os.path.exists(config_path):
        raise EncoderError(f"{name}: no config.json in {folder}; expected a transformers model folder")
    with open(config_path) as fh:
        config = json.load(fh)
    model_type = config.get("model_type", "?")
    if model_type not in SUPPORTED:
        raise EncoderError(f"{name}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}")
    modalities, dim_of = SUPPORTED[model_type]
    preprocessing: dict = {"model_type": model_type}
    processor_path = os.path.join(folder, "preprocessor_config.json")
    if os.path.exists(processor_path):
        with open(processor_path) as fh:
            preprocessing["image_processor"] = json.load(fh)
    return EncoderSpec(
        name=name if not os.path.isdir(target) else f"{PREFIX}{os.path.abspath(target)}",
        family="hf",
        source=source,
        revision=revision,
        dim=int(dim_of(config)),
        preprocessing=preprocessing,
        modalities=modalities,
        extra={"model_type": model_type},
    )


def check_packages(spec: EncoderSpec) -> None:
    """EncoderError, one line naming the model and the fix, when its tokenizer needs a package that is not installed
    here: checked before a run starts (imgest/cli/app.py), before a search loads the model, and before the weights
    load, where transformers would refuse only after them, in a paragraph."""
    if spec.family != "hf" or "text" not in spec.modalities:
        return
    for package in TOKENIZER_PACKAGES.get(spec.extra.get("model_type"), ()):
        try:
            importlib.import_module(package)
        except ImportError as exc:
            raise EncoderError(f"{spec.name}: its tokenizer needs the {package.split('.')[-1]} package, which is not "
                               f"installed here: {HF_EXTRA}") from exc


def _tokenizer(spec: EncoderSpec):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(spec.source)
    except ImportError as exc:  # a package of a tokenizer the table above does not list: transformers names it
        reason = str(exc).strip().split(". ")[0].splitlines()[0][:200]
        raise EncoderError(f"{spec.name}: its tokenizer needs a package that is not installed here ({reason}): "
                           f"install it ({HF_EXTRA} installs SigLIP's)") from exc


def _decode_side(processor) -> int | None:
    """The shorter side a JPEG may be decoded down to for this processor: its resize target (the shortest edge, or
    the larger of a fixed height and width, which a squashing resize needs on both sides), never its crop. None
    when the processor does not resize to a target (it then reads the full image). transformers 5 keeps `size` as
    a SizeDict (attributes, no keys()); a processor saved by 4.x reads back as one too."""
    size = getattr(processor, "size", None)
    if size is None or not getattr(processor, "do_resize", True):
        return None

    def side(name: str):
        value = size.get(name) if isinstance(size, dict) else getattr(size, name, None)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    if side("shortest_edge"):
        return side("shortest_edge")
    fixed = [v for v in (side("height"), side("width")) if v]
    return max(fixed) if fixed else None


def _pixels(processor, image) -> np.ndarray:
    """The processor's own steps (RGB conversion, resize, centre crop) without its rescale and normalisation:
    uint8 CHW. Both of transformers' backends resize and crop in uint8; a processor that hands back other
    numbers is refused unless they are whole pixel values, so nothing is rounded away."""
    pixels = np.asarray(processor(images=[image], return_tensors="np", do_rescale=False,
                                  do_normalize=False)["pixel_values"][0])
    if pixels.dtype != np.uint8:
        if pixels.size and not (np.array_equal(pixels, np.round(pixels)) and pixels.min() >= 0 and pixels.max() <= 255):
            raise EncoderError(f"{type(processor).__name__} resizes to values that are not 8-bit pixels "
                               f"({pixels.dtype}, {pixels.min():.3f}..{pixels.max():.3f})")
        pixels = pixels.astype(np.uint8)
    return pixels


def _resample_plan(processor, height: int, width: int) -> tensors.Resample | None:
    """What `processor` (transformers' Pillow backend) does to an RGB image of this size, as a tensor path's plan:
    its resize (the target size worked out by transformers' own helpers, in the order its backend tries them), its
    filter, its centre crop. None where the tensor path cannot do the same: another filter, a target it pads to."""
    from transformers.image_transforms import get_resize_output_image_size, get_size_with_aspect_ratio
    from transformers.image_utils import ChannelDimension, get_image_size_for_max_height_width

    new = (height, width)
    resample = int(getattr(processor, "resample", tensors.BICUBIC))
    if getattr(processor, "do_resize", True):
        size = processor.size
        if resample not in (tensors.BICUBIC, tensors.BILINEAR):
            return None
        if size.shortest_edge and size.longest_edge:
            new = get_size_with_aspect_ratio((height, width), size.shortest_edge, size.longest_edge)
        elif size.shortest_edge:  # the helper reads the image's shape only: a broadcast view of one byte
            shape = np.broadcast_to(np.zeros((), np.uint8), (3, height, width))
            new = get_resize_output_image_size(shape, size=size.shortest_edge, default_to_square=False,
                                               input_data_format=ChannelDimension.FIRST)
        elif size.max_height and size.max_width:
            new = get_image_size_for_max_height_width((height, width), size.max_height, size.max_width)
        elif size.height and size.width:
            new = (size.height, size.width)
        else:
            return None
    new = (int(new[0]), int(new[1]))
    crop = None
    if getattr(processor, "do_center_crop", False):
        crop_h, crop_w = processor.crop_size.height, processor.crop_size.width
        top, left = (new[0] - crop_h) // 2, (new[1] - crop_w) // 2  # transformers' center_crop
        if top < 0 or left < 0:  # it pads a smaller image: the processor's own path does that
            return None
        crop = (top, left, crop_h, crop_w)
    return tensors.Resample((0.0, 0.0, float(width), float(height)), new, resample, crop)


@functools.lru_cache(maxsize=4)
def _processor(source: str):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(source, backend=PROCESSOR_BACKEND)


def hf_preprocess(source: str, image) -> np.ndarray:
    """`HFEncoder.preprocess` for a decode process: only the model folder's path crosses the process boundary,
    and each process loads the processor from it once."""
    return _pixels(_processor(source), image)


def _normalisation(processor) -> tuple[float, np.ndarray, np.ndarray]:
    """The processor's rescale factor, per-channel mean and std as its config applies them (a step it skips:
    1, 0, 1); the mean and std shaped (1, C, 1, 1) for an NCHW batch."""
    scale = float(processor.rescale_factor) if processor.do_rescale else 1.0
    mean, std = (processor.image_mean, processor.image_std) if processor.do_normalize else (0.0, 1.0)
    return scale, *(np.asarray(v, np.float32).reshape(1, -1, 1, 1) for v in (mean, std))


def _image_features(self, pixels):
    """uint8 NCHW -> features: the processor's rescale and mean/std on the batch (so in a compiled graph too),
    then the model."""
    pixel_values = (pixels.float() * self.scale - self.mean) / self.std
    if self.model_type == "dinov2":
        return self.model(pixel_values=pixel_values).pooler_output
    return _pooled(self.model.get_image_features(pixel_values=pixel_values))


def _text_features(self, input_ids, attention_mask=None):
    tokens = {"input_ids": input_ids} if attention_mask is None else \
        {"input_ids": input_ids, "attention_mask": attention_mask}
    return _pooled(self.model.get_text_features(**tokens))


TOKEN_INPUTS = ("input_ids", "attention_mask")  # what the text tower reads of the tokenizer's output, in order


class HFEncoder(GraphEncoder):
    def __init__(self, spec: EncoderSpec, device: str):
        import torch
        from transformers import AutoImageProcessor, AutoModel

        self.spec, self.device = spec, device
        self.model_type = spec.extra["model_type"]
        check_packages(spec)  # before the weights: a refusal costs nothing
        try:  # safetensors only (never a pickled .bin), and never a model's own code (trust_remote_code stays off)
            self.model = AutoModel.from_pretrained(spec.source, use_safetensors=True,
                                                   trust_remote_code=False).eval().to(device)
        except (OSError, ValueError) as exc:
            raise EncoderError(f"{spec.name}: cannot load its weights as safetensors without running the model's own "
                               f"code ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from exc
        self.processor = AutoImageProcessor.from_pretrained(spec.source, backend=PROCESSOR_BACKEND)
        self.tokenizer = _tokenizer(spec) if "text" in spec.modalities else None
        self.input_shape = tuple(self.preprocess(_blank()).shape)
        self.decode_side = _decode_side(self.processor)
        # its vectors decode down to that side only where the reduced decode passes a gate against the processor's
        # own path on the whole image (tasks/ingest/decoder.py); stores recorded before sides were decoded whole
        self.gated_decode_side, self.legacy_decode_side = True, None
        # picklable, so decode processes preprocess (tasks/ingest/encode.py); a hub model's source is its snapshot
        self.preprocess_fn = functools.partial(hf_preprocess, spec.source)
        scale, mean, std = _normalisation(self.processor)
        self._image_tower = torch_module(
            _image_features, model=self.model,
            scale=torch.tensor(scale, dtype=torch.float32, device=device),
            mean=torch.from_numpy(mean).to(device), std=torch.from_numpy(std).to(device))
        self._image_tower.model_type = self.model_type
        self._text_tower = None
        if self.tokenizer is not None:
            self._text_tower = torch_module(_text_features, model=self.model)
        self._run_on("torch", default_precision(device))

    def graphs(self) -> dict[str, Graph]:
        towers = {"image": Graph("image", self._image_tower, (np.zeros((2, *self.input_shape), np.uint8),), ((0,),))}
        if self._text_tower is not None:
            example = tuple(v.numpy() for v in self._tokens(["a photo", "a photo of a red shoe"]).values())
            towers["text"] = Graph("text", self._text_tower, example, tuple((0, 1) for _ in example))
        return towers

    def _tokens(self, texts: Sequence[str]) -> dict:
        max_len = self.model.config.text_config.max_position_embeddings
        if self.model_type == "siglip":
            # As transformers documents SigLIP (its model doc; SiglipModel.get_text_features' example): padded to
            # the length it was trained at, padding="max_length", and the tokens alone, no attention mask. Its
            # checkpoints' tokenizers return input_ids only (transformers' SigLIP conversion saves them with
            # model_input_names=["input_ids"]: the original model takes no mask), so the documented
            # get_text_features(**tokenizer(texts, padding="max_length")) runs unmasked and pools the last
            # position, a padding token. A mask would change every embedding, so one is never passed, whatever a
            # folder's tokenizer returns.
            tokens = self.tokenizer(list(texts), padding="max_length", truncation=True, max_length=max_len,
                                    return_tensors="pt")
            return {"input_ids": tokens["input_ids"]}
        tokens = self.tokenizer(list(texts), padding=True, truncation=True, max_length=max_len, return_tensors="pt")
        return {k: tokens[k] for k in TOKEN_INPUTS if k in tokens}

    def preprocess(self, image) -> np.ndarray:
        """uint8 CHW: decode workers ship a quarter of the bytes of float pixels and do no float work."""
        return _pixels(self.processor, image)

    def resample_plan(self, height: int, width: int) -> tensors.Resample | None:
        """`preprocess` of an upright RGB image of this size as the tensor path runs it, or None (the CPU path)."""
        return _resample_plan(self.processor, height, width)

    def encode_images(self, batch: np.ndarray) -> np.ndarray:
        return l2_normalise(self.runners["image"](batch))

    def encode_texts(self, texts: Sequence[str]) -> np.ndarray:
        if self.tokenizer is None:
            raise EncoderError(f"{self.spec.name} ({self.model_type}) is image-only: it has no text tower")
        return l2_normalise(self.runners["text"](*self._tokens(texts).values()))


def _pooled(output):
    # transformers 5 returns a ModelOutput whose pooler_output is the projected embedding; 4.x a tensor.
    return output if hasattr(output, "dim") else output.pooler_output


def _blank():
    from PIL import Image

    return Image.new("RGB", (256, 256), "white")


def load(spec: EncoderSpec, device: str) -> HFEncoder:
    return HFEncoder(spec, device)
