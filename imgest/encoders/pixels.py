"""Raw-pixel baseline: the image shrunk to 16x16 RGB, centred and L2-normalised (768-d).

Not a model anyone should serve; it is the floor a learned encoder has to beat in an evaluation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from imgest.encoders.base import EncoderError, EncoderSpec

NAME = "raw-pixels"
SIDE = 16
PREPROCESSING = {"resize": [SIDE, SIDE], "interpolation": "box", "centre": "per-image mean", "dtype": "float32"}


def resolve(name: str) -> EncoderSpec:
    revision = hashlib.sha256(f"{NAME}-v1".encode()).hexdigest()  # no weights: the code version is the pin
    return EncoderSpec(name=NAME, family=NAME, source="builtin", revision=revision, dim=3 * SIDE * SIDE,
                       preprocessing=PREPROCESSING, modalities=("image",))


class RawPixels:
    input_shape = (3, SIDE, SIDE)
    decode_side = SIDE
    runtime, precision, runners = "numpy", "fp32", {}  # no graph for a runtime to compile: it runs as it is

    def graphs(self) -> dict:
        return {}

    def __init__(self, spec: EncoderSpec, device: str):
        self.spec, self.device = spec, device

    def preprocess(self, image) -> np.ndarray:
        from PIL import Image

        small = image.resize((SIDE, SIDE), Image.Resampling.BOX)
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
