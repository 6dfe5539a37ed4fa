"""Raw-pixel baseline: the image shrunk to 16x16 RGB, centred and L2-normalised (768-d).

Not a model anyone should serve; it is the floor a learned encoder has to beat in an evaluation. `raw-pixels-<side>`
shrinks to another square (2-32 px: `raw-pixels-4` is 48-d): the cheapest encoder there is, for rehearsing the
pipeline at catalogue scale where the vectors' size, not the model, is what is being measured.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import numpy as np

from imgest.encoders.base import EncoderError, EncoderSpec

NAME = "raw-pixels"
SIDE = 16
SIDES = range(2, 33)
SIZED = re.compile(rf"^{NAME}-([1-9][0-9]?)$")  # one spelling per side: no leading zero


def sized(name: str) -> bool:
    """`raw-pixels-<side>` with a side in SIDES."""
    match = SIZED.match(name)
    return match is not None and int(match.group(1)) in SIDES


def preprocessing(side: int) -> dict:
    return {"resize": [side, side], "interpolation": "box", "centre": "per-image mean", "dtype": "float32"}


def resolve(name: str) -> EncoderSpec:
    side = SIDE if name == NAME else int(SIZED.match(name).group(1))
    revision = hashlib.sha256(f"{NAME}-v1".encode()).hexdigest()  # no weights: the code version is the pin
    return EncoderSpec(name=name, family=NAME, source="builtin", revision=revision, dim=3 * side * side,
                       preprocessing=preprocessing(side), modalities=("image",))


class RawPixels:
    runtime, precision, runners = "numpy", "fp32", {}  # no graph for a runtime to compile: it runs as it is

    def graphs(self) -> dict:
        return {}

    def __init__(self, spec: EncoderSpec, device: str):
        self.spec, self.device = spec, device
        self.side = spec.preprocessing["resize"][0]
        self.input_shape, self.decode_side = (3, self.side, self.side), self.side

    def preprocess(self, image) -> np.ndarray:
        from PIL import Image

        small = image.resize((self.side, self.side), Image.Resampling.BOX)
        return np.asarray(small, np.float32).transpose(2, 0, 1) / 255.0

    def encode_images(self, batch: np.ndarray) -> np.ndarray:
        flat = batch.reshape(len(batch), -1).astype(np.float32)
        flat -= flat.mean(axis=1, keepdims=True)
        norms = np.linalg.norm(flat, axis=1, keepdims=True)
        return flat / np.maximum(norms, 1e-12)

    def encode_texts(self, texts: Sequence[str]) -> np.ndarray:
        raise EncoderError(f"{NAME} is an image-only baseline: it has no text tower")


def load(spec: EncoderSpec, device: str) -> RawPixels:
    return RawPixels(spec, device)
