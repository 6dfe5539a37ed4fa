"""Kept pixels: a reduced copy of a catalogue image, made from the pixels the model's decode already has when they
reach the copy's side (else from a second decode at that side: the model's own pixels never change), so that a later
model reads the copy instead of fetching and decoding the original again (img2dataset keeps resized copies for
the same reason).

A copy keeps the aspect ratio and the whole image (no crop), at a shorter side of at least SIDE and under twice
it: a JPEG is kept as its DCT-scaled decode made it (1/2, 1/4, 1/8 with Pillow, eighths with libjpeg-turbo's
decoders), any other image box-reduced by a whole factor, as the DCT scaling does; never enlarged. It is not
resampled to SIDE exactly: a model resizes the copy with its own preprocessing, and two resamples in a row moved
EfficientNet-Lite0-GeM's embeddings below the reduced-precision gate even with lossless copies (mean cosine 0.994
at side 256, PNG), while the decode's own pixels kept as a JPEG at quality 97 with full chroma (4:4:4) pass it
(mean cosine 0.9984, 0.994 at the 1st percentile, overlap@10 0.98 through simplejpeg; quality 95 and 4:2:0 do
not). Measured on the parity sample's 256 product photos (BENCHMARKS.md, "Kept pixels"; docs/ingest.md). A model
reads copies only when its recorded decode side is no more than SIDE (`fits`) and passes the gate on them
(tasks/ingest/kept.py).
"""

from __future__ import annotations

import io

from PIL import Image

CODEC = "jpeg"
QUALITY = 97
SUBSAMPLING = "4:4:4"
MAX_COPY_BYTES = 4 << 20  # a kept copy larger than this was not made by imgest: refused before it is decoded
MAX_COPY_PIXELS = 4096 * 4096 * 4  # ... and one declaring more pixels (a side of 4096 at most, aspect up to 4:1)


def reduction(size: tuple[int, int], side: int) -> int:
    """The whole factor an image of `size` is box-reduced by for a copy at `side`: its shorter side stays at least
    `side` (1 when it is under twice `side`)."""
    return max(1, min(size) // side)


def make_copy(image: Image.Image, side: int, quality: int = QUALITY) -> tuple[bytes, int, int]:
    """An RGB image's kept copy: (JPEG bytes, width, height)."""
    factor = reduction(image.size, side)
    small = image.reduce(factor) if factor > 1 else image
    out = io.BytesIO()
    small.save(out, "JPEG", quality=quality, subsampling=SUBSAMPLING)
    return out.getvalue(), small.size[0], small.size[1]


def fits(decode_side: int | None, side: int) -> bool:
    """Whether a model whose preprocessing needs `decode_side` can read copies of shorter side `side`."""
    return decode_side is not None and 0 < decode_side <= side
