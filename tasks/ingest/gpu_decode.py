"""JPEG decode on the GPU: nvJPEG through `torchvision.io.decode_jpeg(..., device="cuda")`, batched.

On by itself when the encoder runs on CUDA, torchvision's image decoder loads (the optional extra
`imgest[gpu]`) and the encoder can preprocess a decoded tensor (`preprocess_tensor`). Decode threads still
read and hash every object; a plain JPEG (8-bit RGB or grey, within --max-pixels) ships its bytes to the
encoder's thread, which decodes the batch in one call on the GPU and resizes there. Everything else (PNG,
CMYK, what nvJPEG refuses) is decoded by Pillow as before, one image at a time, so a batch with one odd
file still encodes the rest.
"""

from __future__ import annotations

import io
import warnings

from PIL import Image

from imgest.images.decode import DecodeError, decode_image


def plain_jpeg(data: bytes, max_pixels: int) -> bool:
    """A JPEG nvJPEG decodes to the RGB Pillow would give: 8-bit YCbCr/RGB or grey, not CMYK or 12-bit.
    Reads the header only; anything doubtful answers False and takes the Pillow path."""
    if data[:3] != b"\xff\xd8\xff":
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            image = Image.open(io.BytesIO(data))
            return (image.format == "JPEG" and image.mode in ("RGB", "L")
                    and image.width * image.height <= max_pixels)
    except Exception:  # noqa: BLE001 - a header Pillow cannot read is the Pillow path's to reject
        return False


class BatchJpegDecoder:
    """Decodes a batch of JPEG bytes on `device` and preprocesses each with the encoder's tensor path."""

    def __init__(self, device: str, preprocess_tensor, preprocess, max_pixels: int, min_side: int | None):
        from torchvision.io import ImageReadMode, decode_jpeg

        self.device, self._decode, self._rgb = device, decode_jpeg, ImageReadMode.RGB
        self.preprocess_tensor, self.preprocess = preprocess_tensor, preprocess
        self.max_pixels, self.min_side = max_pixels, min_side
        self.gpu_decoded = self.fallbacks = 0

    @classmethod
    def for_encoder(cls, encoder, max_pixels: int) -> BatchJpegDecoder | None:
        """One for a CUDA encoder with a tensor preprocessing path when torchvision decodes; else None."""
        device = str(getattr(encoder, "device", "cpu"))
        if not device.startswith("cuda") or not hasattr(encoder, "preprocess_tensor"):
            return None
        try:
            return cls(device, encoder.preprocess_tensor, encoder.preprocess, max_pixels,
                       getattr(encoder, "decode_side", None))
        except (ImportError, OSError, RuntimeError):  # no torchvision, or its image library did not load
            return None

    def decode(self, blobs: list[bytes]) -> list:
        """Model-ready pixels for each blob, in order: a tensor on `device`, a NumPy array (Pillow's path),
        or a DecodeError when neither decoder can read it."""
        import torch

        tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
        try:
            images = self._decode(tensors, mode=self._rgb, device=self.device, apply_exif_orientation=True)
        except Exception:  # noqa: BLE001 - one bad image fails the whole call: one by one to find it
            images = [self._one(t) for t in tensors]
        out = []
        for data, image in zip(blobs, images):
            if image is None:
                self.fallbacks += 1
                out.append(self._pillow(data))
            else:
                self.gpu_decoded += 1
                out.append(self.preprocess_tensor(image))
        return out

    def _one(self, tensor):
        try:
            return self._decode(tensor, mode=self._rgb, device=self.device, apply_exif_orientation=True)
        except Exception:  # noqa: BLE001 - nvJPEG refused it: Pillow decides
            return None

    def _pillow(self, data: bytes):
        try:
            return self.preprocess(decode_image(data, self.max_pixels, self.min_side))
        except DecodeError as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 - the model's preprocessing refused it, as in prepare()
            return DecodeError(f"{type(exc).__name__} in preprocessing: {exc}")
