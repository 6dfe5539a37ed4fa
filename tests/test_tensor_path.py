"""The device-agnostic half of the GPU path (imgest/images/tensors.py), on CPU tensors: EXIF orientation as flips
and rotations, Pillow's resampling as matrix products, batches of one size resampled together."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from imgest.images import tensors


def _chw(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image.convert("RGB")).transpose(2, 0, 1).copy())


def _with_orientation(image: Image.Image, value: int, fmt: str = "JPEG") -> bytes:
    exif = image.getexif()
    exif[tensors.ORIENTATION] = value
    buf = io.BytesIO()
    image.save(buf, fmt, exif=exif.tobytes(), **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


@pytest.mark.parametrize("value", range(1, 9))
def test_every_exif_orientation_equals_pillows_exif_transpose(value):
    rng = np.random.default_rng(value)
    upright = Image.fromarray(rng.integers(0, 256, (5, 7, 3), dtype=np.uint8))  # not square: turns show
    data = _with_orientation(upright, value, "PNG")  # lossless: the same pixels on both sides
    assert tensors.orientation(data) == value
    expected = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    got = tensors.orient(_chw(upright), value).numpy().transpose(1, 2, 0)
    assert got.shape == expected.shape and np.array_equal(got, expected)


def test_an_absent_or_unreadable_orientation_is_upright():
    plain = io.BytesIO()
    Image.new("RGB", (4, 4)).save(plain, "JPEG")
    assert tensors.orientation(plain.getvalue()) == 1
    assert tensors.orientation(b"\xff\xd8\xff not a jpeg") == 1
    assert tensors.orientation(_with_orientation(Image.new("RGB", (4, 4)), 9)) == 1  # out of range


@pytest.mark.parametrize("resample", [tensors.BICUBIC, tensors.BILINEAR])
@pytest.mark.parametrize("box, size", [((10.5, 3.25, 300.0, 292.75), (224, 224)),  # a fractional window, shrunk
                                       ((0, 0, 451, 300), (256, 384)),  # the whole image, shrunk
                                       ((0, 0, 451, 300), (400, 600))])  # enlarged
def test_resampling_gives_pillows_pixels(box, size, resample):
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (300, 451, 3), dtype=np.uint8))
    expected = np.asarray(image.resize(size[::-1], resample, box=box)).transpose(2, 0, 1)
    got = tensors.resample(_chw(image), tensors.Resample(box, size, resample)).numpy()
    assert got.shape == expected.shape and np.array_equal(got, expected)  # its fixed point, so every pixel


def test_a_batch_of_mixed_sizes_is_each_image_through_its_own_plan():
    rng = np.random.default_rng(1)
    images = [_chw(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))
              for h, w in ((120, 90), (80, 80), (120, 90))]
    plans = [tensors.Resample((0, 0, 90, 120), (64, 48), crop=(8, 0, 48, 48)),
             tensors.Resample((4.5, 4.5, 75.5, 75.5), (48, 48)),
             tensors.Resample((0, 0, 90, 120), (64, 48), crop=(8, 0, 48, 48))]
    batch = tensors.model_ready(images, plans)
    assert batch.shape == (3, 3, 48, 48) and batch.dtype == torch.uint8
    for image, plan, got in zip(images, plans, batch):
        assert torch.equal(got, tensors.resample(image, plan))
