"""Perceptual hashes of decoded images (imagehash's DCT hash, 64 bits): the second duplicate signal, kept per
content hash so each image is decoded for it once, whatever model is served.

  duplicates/hashes/<run>.parquet   content_hash, phash (uint64): the newest file holds every hash so far
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa

from imgest.storage import Location, RecordError, StorageError

PREFIX = "duplicates/hashes"
_SCHEMA = pa.schema([("content_hash", pa.string()), ("phash", pa.uint64())])


HASH_SIDE = 64  # the shorter side an image is decoded to for hashing (a large JPEG decodes at 1/2-1/8 scale)
KEPT_SIDE = 256  # the longer side of the small copy kept for hashing and comparing


def picture(data: bytes):
    """An image's bytes decoded upright, small: what hashes and comparisons read."""
    from imgest.tasks.ingest.decode import decode_image

    image = decode_image(data, min_side=HASH_SIDE)
    image.thumbnail((KEPT_SIDE, KEPT_SIDE))
    return image


def content_box(image) -> tuple[int, int, int, int]:
    """The box of the picture inside a uniform near-white margin (a padded copy and its original share it;
    decoding composites transparency on white, so a cut-out's transparent margin is margin too)."""
    from PIL import Image, ImageChops

    grey = image.convert("L")
    box = ImageChops.difference(grey, Image.new("L", grey.size, 255)).point(lambda v: 255 if v > 32 else 0).getbbox()
    return box or (0, 0, *grey.size)


def content(image):
    """The picture without its margin (content_box), in grey."""
    return image.convert("L").crop(content_box(image))


def perceptual_hash(image) -> int:
    """The 64-bit DCT hash (imagehash.phash) of an upright decoded image's content (see content())."""
    import imagehash

    bits = imagehash.phash(content(image)).hash.flatten()
    return int(np.packbits(bits).view(">u8")[0])


def hamming(a: int, b: int) -> int:
    return (a ^ b).bit_count()


def read_hashes(store: Location, max_rows: int) -> dict[str, int]:
    """Every stored hash by content hash. A file that is not one imgest wrote, or holds more than `max_rows`
    rows, or cannot be read now, is skipped with a warning: it is a cache, its images are hashed again."""
    hashes: dict[str, int] = {}
    for name in sorted(n for n in store.list_names(PREFIX) if n.endswith(".parquet")):
        try:
            table = store.read_table(f"{PREFIX}/{name}", columns=["content_hash", "phash"], max_rows=max_rows)
            if table.schema != _SCHEMA:
                raise RecordError(f"columns {table.schema.types}, not (string, uint64)")
        except (RecordError, StorageError, ValueError, OSError, pa.ArrowException) as exc:
            logging.getLogger("imgest").warning("%s: %s/%s is not a hash file imgest wrote (%s): skipped",
                                                store.url, PREFIX, name, exc)
            continue
        hashes.update(zip(table.column("content_hash").to_pylist(), table.column("phash").to_pylist()))
    return hashes


def write_hashes(store: Location, hashes: dict[str, int], run: str) -> None:
    """Write every hash in one new file, then delete the older ones (a kill between leaves both, which read
    as their union)."""
    older = [n for n in store.list_names(PREFIX) if n.endswith(".parquet")]
    table = pa.table({"content_hash": pa.array(list(hashes), pa.string()),
                      "phash": pa.array(list(hashes.values()), pa.uint64())}, schema=_SCHEMA)
    store.write_table(f"{PREFIX}/{run}.parquet", table)
    for name in older:
        if name != f"{run}.parquet":
            store.delete(f"{PREFIX}/{name}")
