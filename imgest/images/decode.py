"""Decode image bytes with Pillow into RGB, or say precisely why not."""

from __future__ import annotations

import io
import math
import warnings

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from imgest.images import decoders
from imgest.names import DEFAULT_MAX_PIXELS

# Two guards against decompression bombs, both before any pixel is decoded: ours (`max_pixels`, the
# --max-pixels of the call) is checked after open() has read the header; Pillow's own stays as a backstop
# (it warns above MAX_IMAGE_PIXELS and refuses above twice that inside open()), set to imgest's limit and
# raised, never lowered, to the largest --max-pixels a call asks for.
Image.MAX_IMAGE_PIXELS = DEFAULT_MAX_PIXELS
JPEG_REDUCING_GAP = 1  # a JPEG's DCT-scaled decode keeps its shorter side at least this many times the needed side
REDUCING_GAP = 2  # a 16-bit or float image's box reduction keeps at least this many times the needed side
WIDE_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N", "F")  # more than 8 bits a sample: scaled to 8 bits
BAND_PIXELS = 1 << 20  # wide samples are converted this many at a time: float64 temporaries stay at 8 MB


class DecodeError(ValueError):
    """An object could not be turned into an RGB image; str() is the reason recorded for it."""


def _reason(exc: BaseException) -> str:
    if isinstance(exc, UnidentifiedImageError):  # Pillow's message names a BytesIO's memory address
        return (f"{type(exc).__name__}: not in an image format Pillow reads (JPEG, PNG, WebP, GIF, TIFF, BMP, "
                "and the others listed by `python -m PIL`)")
    return f"{type(exc).__name__}: {exc}"


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS, min_side: int | None = None,
                 decoder: str = decoders.PILLOW) -> Image.Image:
    """Bytes -> RGB image with EXIF orientation applied.

    Every mode becomes RGB: alpha is composited on white, 16-bit and float images are scaled to
    8 bits, CMYK and palettes are converted, animations give their first frame. With `min_side` (the
    shorter side the encoder's preprocessing needs), a JPEG is decoded at 1/2, 1/4 or 1/8 scale in the
    DCT domain (libjpeg's scaled decode, Pillow's `draft`) while its shorter side stays at least `min_side`:
    about 2x faster decode + preprocessing than the full decode on product photos. The embeddings move a
    little (cosine 0.996 on average on real photos, 0.98 at worst on dense fine textures such as gravel), and
    retrieval does not: recall@1 and @10 across a real shift equal the full decode's (BENCHMARKS.md, "Encoder
    runtimes"; docs/ingest.md). A 16-bit or float image is box-averaged (an integer factor, the shorter side
    kept at least twice `min_side`) while it is scaled to 8 bits. With another `decoder`
    (imgest/images/decoders.py), a plain colour or greyscale JPEG is decoded by it at the smallest of
    libjpeg-turbo's eighths that keeps `min_side`, and turned upright by its EXIF orientation as Pillow would.

    Memory follows the decoded image and the output, never a float copy of the whole image: a declared
    size over `max_pixels` is refused after the header is read, before any pixel is decoded, and wide
    samples are reduced and scaled a band of rows at a time.
    """
    if not data:
        raise DecodeError("EmptyFile: object has 0 bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if max_pixels > Image.MAX_IMAGE_PIXELS:  # only ever raised: a thread with a lower limit checks its own
                Image.MAX_IMAGE_PIXELS = max_pixels
            try:
                image = Image.open(io.BytesIO(data))
            except Image.DecompressionBombError as exc:  # over twice Pillow's guard: refused inside open()
                raise DecodeError(f"DecompressionBombError: the declared size exceeds the limit of {max_pixels} "
                                  f"pixels (--max-pixels); Pillow: {exc}") from exc
            width, height = image.size
            if width * height > max_pixels:
                raise DecodeError(
                    f"DecompressionBombError: {width}x{height} = {width * height} pixels exceeds the limit of "
                    f"{max_pixels} (--max-pixels)"
                )
            if getattr(image, "n_frames", 1) > 1:
                image.seek(0)
            if decoder != decoders.PILLOW and image.format == "JPEG" and image.mode in ("RGB", "L") \
                    and (scaled := _scaled(decoder, data, image, min_side)) is not None:
                return scaled
            if min_side and image.format == "JPEG" and min(width, height) >= 2 * JPEG_REDUCING_GAP * min_side:
                scale = JPEG_REDUCING_GAP * min_side / min(width, height)
                image.draft(None, (math.ceil(width * scale), math.ceil(height * scale)))
            image.load()
            ImageOps.exif_transpose(image, in_place=True)  # not in place, it copies every upright image
            return to_rgb(image, min_side)
    except DecodeError:
        raise
    except Exception as exc:  # Pillow raises many types for bad data; each becomes a recorded reason
        raise DecodeError(_reason(exc)) from exc


def decode_as(data: bytes, how: decoders.Decode, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """`data` decoded as a model's vectors are made (`how`: its recorded decoder and decode side)."""
    return decode_image(data, max_pixels, how.side, how.decoder)


def _scaled(decoder: str, data: bytes, header: Image.Image, min_side: int | None) -> Image.Image | None:
    """`data` decoded by `decoder` and turned upright by the orientation `header` (Pillow's open) read; None when
    that decoder cannot decode it (Pillow then decodes it, or gives the reason it is not an image)."""
    try:
        pixels = decoders.get(decoder).scaled(data, header.size, min_side and JPEG_REDUCING_GAP * min_side)
    except Exception:  # a variant it does not handle (arithmetic coding, a damaged stream): Pillow's call
        return None
    image = Image.fromarray(pixels)
    if "exif" in header.info:
        image.info["exif"] = header.info["exif"]
    ImageOps.exif_transpose(image, in_place=True)
    return image


def to_rgb(image: Image.Image, min_side: int | None = None) -> Image.Image:
    """`image` as 8-bit RGB; with `min_side`, a 16-bit or float image is also reduced (see decode_image)."""
    mode = image.mode
    if mode == "RGB":
        return image
    if mode in WIDE_MODES:
        return _eight_bit(image, _factor(image.size, min_side)).convert("RGB")
    if mode == "P" and "transparency" in image.info or mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image if mode == "RGBA" else image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _factor(size: tuple[int, int], min_side: int | None) -> int:
    """The box-reduction factor of a wide image: its shorter side stays at least REDUCING_GAP x min_side,
    and, as for JPEGs, only an image at least twice that large is reduced."""
    if not min_side or min(size) < 2 * REDUCING_GAP * min_side:
        return 1
    return min(size) // (REDUCING_GAP * min_side)


def _eight_bit(image: Image.Image, factor: int) -> Image.Image:
    """A 16-bit, 32-bit or float greyscale image as 8-bit "L", each `factor` x `factor` block averaged.

    16-bit samples map 0..65535 to 0..255; other wide samples 0..255 as they are unless one exceeds 255,
    then 0..65535 too (a 16-bit PNG that Pillow opened as "I"); rounded, clipped. The image is read a band
    of rows at a time (a crop), so neither a full-size NumPy copy nor a full-size float array is made; the
    last partial block of each side is dropped when reducing.
    """
    width, height = image.size
    if image.mode.startswith("I;16"):
        top = 65535.0
    else:
        _, high = image.getextrema()
        top = 65535.0 if high > 255 else 255.0
    out_w, out_h = width // factor, height // factor
    out = np.empty((out_h, out_w), np.uint8)
    rows = max(1, BAND_PIXELS // max(width * factor, 1))  # output rows per band
    for row in range(0, out_h, rows):
        stop = min(row + rows, out_h)
        top_px, bottom_px = row * factor, min(stop * factor, height)
        band = np.asarray(image.crop((0, top_px, min(out_w * factor, width), bottom_px)), dtype=np.float64)
        if factor > 1:
            band = band.reshape(stop - row, factor, out_w, factor).mean(axis=(1, 3))
        out[row:stop] = np.clip(band / top * 255.0 + 0.5, 0, 255).astype(np.uint8)
    return Image.fromarray(out)
