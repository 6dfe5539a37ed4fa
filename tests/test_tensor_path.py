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


def test_an_unusable_gpu_is_explained_with_its_driver_and_torchs_build(tmp_path, monkeypatch):
    import warnings

    from imgest.encoders import base

    assert base.unusable_gpu() is None or "a GPU is here" in base.unusable_gpu()  # this host, whatever it has
    gpu, driver = tmp_path / "nvidiactl", tmp_path / "version"
    gpu.write_bytes(b"")
    driver.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  470.256.02  Thu May  2 14:37:44 UTC 2024\n")
    monkeypatch.setattr(base, "GPU_DEVICE_FILES", (str(gpu),))
    monkeypatch.setattr(base, "NVIDIA_DRIVER", str(driver))
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu_build = base.unusable_gpu()
    assert cpu_build.startswith("a GPU is here (driver 470.256.02)") and "is a CPU build" in cpu_build

    def too_old():  # what torch's CUDA build says on a host whose driver predates its CUDA
        warnings.warn("CUDA initialization: The NVIDIA driver on your system is too old (found version 11040). "
                      "Please update your GPU driver", UserWarning, stacklevel=1)
        return False

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", too_old)
    old = base.unusable_gpu()
    assert "built for CUDA 13.0" in old and "driver on your system is too old" in old and "\n" not in old
    monkeypatch.setattr(base, "GPU_DEVICE_FILES", (str(tmp_path / "absent"),))
    assert base.unusable_gpu() is None  # no GPU: nothing to explain
