"""The copies of an image a catalogue really holds, made on purpose: JPEG re-encodes, PNG <-> JPEG with the
alpha composited, resizes, small crops and pads, and a rotation recorded in EXIF. Calibration embeds them
to learn what score a copy gets under a model (tasks/duplicates/calibrate.py).
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageOps

KINDS = ("jpeg", "format", "resize", "crop", "pad", "exif-rotation")
JPEG_QUALITIES = (50, 95)  # re-encodes drawn between these (inclusive)
SCALES = (0.5, 2.0)  # resizes drawn between these, as a factor of each side
EDGE = (0.02, 0.10)  # crops and pads: this share of each side, drawn per side
LARGEST_SIDE = 2048  # a resize never makes more than this (the original may be larger)
# EXIF orientation -> how the pixels are stored turned (counter-clockwise) so that the tag turns them upright
# again, as a phone or a scanner writes them; decode_image applies the tag.
STORED_TURN = {3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270}


def _flat(image: Image.Image) -> Image.Image:
    """RGB with any transparency composited on white, as a shop re-saving art as JPEG does."""
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _save(image: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    if fmt == "PNG":  # lossless at any level: the copy lives only to be embedded, so the fastest (5x level 6)
        options.setdefault("compress_level", 1)
    image.save(buf, fmt, **options)
    return buf.getvalue()


def _same_format(image: Image.Image, fmt: str | None, rng: np.random.Generator) -> bytes:
    """Saved again the way the original was stored (a PNG keeps its alpha; anything else becomes a JPEG)."""
    if fmt == "PNG":
        return _save(image, "PNG")
    return _save(_flat(image), "JPEG", quality=int(rng.integers(80, 96)))


def make_variant(data: bytes, kind: str, rng: np.random.Generator) -> bytes:
    """One copy of the image in `data`, of `kind` (one of KINDS), with its parameters drawn from `rng`."""
    if kind not in KINDS:
        raise ValueError(f"unknown variant kind {kind!r}; kinds: {', '.join(KINDS)}")
    with Image.open(io.BytesIO(data)) as opened:
        fmt = opened.format
        opened.load()
        image = ImageOps.exif_transpose(opened)
    width, height = image.size
    if kind == "jpeg":
        low, high = JPEG_QUALITIES
        return _save(_flat(image), "JPEG", quality=int(rng.integers(low, high + 1)))
    if kind == "format":  # a PNG becomes a JPEG (alpha on white), anything else a PNG
        if fmt == "PNG":
            return _save(_flat(image), "JPEG", quality=int(rng.integers(85, 96)))
        return _save(_flat(image), "PNG")
    if kind == "resize":
        scale = float(rng.uniform(*SCALES))
        scale = min(scale, LARGEST_SIDE / max(width, height)) if max(width, height) * scale > LARGEST_SIDE else scale
        size = (max(8, round(width * scale)), max(8, round(height * scale)))
        return _same_format(image.resize(size, Image.Resampling.LANCZOS), fmt, rng)
    if kind == "crop":
        left, top, right, bottom = (rng.uniform(*EDGE) for _ in range(4))
        box = (round(width * left), round(height * top), width - round(width * right), height - round(height * bottom))
        return _same_format(image.crop(box), fmt, rng)
    if kind == "pad":
        left, top, right, bottom = (round(side * rng.uniform(*EDGE)) for side in (width, height, width, height))
        fill = (255, 255, 255, 0) if image.mode == "RGBA" else "white"
        canvas = Image.new(image.mode if image.mode in ("RGB", "RGBA") else "RGB",
                           (width + left + right, height + top + bottom), fill)
        canvas.paste(image if image.mode == canvas.mode else image.convert(canvas.mode), (left, top))
        return _same_format(canvas, fmt, rng)
    orientation = int(rng.choice(sorted(STORED_TURN)))  # exif-rotation
    turned = _flat(image).transpose(STORED_TURN[orientation])
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _save(turned, "JPEG", quality=int(rng.integers(85, 96)), exif=exif.tobytes())

