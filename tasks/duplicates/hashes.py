"""Perceptual hashes of decoded images (imagehash's DCT hash, 64 bits): the second duplicate signal, kept per
content hash so each image is decoded for it once, whatever model is served.

  duplicates/hashes/<run>.parquet   content_hash, phash (uint64): the newest file holds every hash so far of
                                    the images live when it was written
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from imgest.scratch import scratch_folder
from imgest.state.layout import DUPLICATE_HASHES as PREFIX
from imgest.state.rows import scratch_sql, sql_string
from imgest.storage import Location, RecordError, StorageError

_SCHEMA = pa.schema([("content_hash", pa.string()), ("phash", pa.uint64())])


HASH_SIDE = 64  # the shorter side an image is decoded to for hashing (a large JPEG decodes at 1/2-1/8 scale)
KEPT_SIDE = 256  # the longer side of the small copy kept for hashing and comparing


def picture(data: bytes):
    """An image's bytes decoded upright, small: what hashes and comparisons read."""
    from imgest.images.decode import decode_image

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


class HashCache:
    """The stored hashes, copied to local disk and queried there with DuckDB: a run looks up the hashes of its
    candidate pairs and writes the cache anew without holding every hash the store has. A file that is not one
    imgest wrote, holds more than `max_rows` rows, or cannot be read now, is skipped with a warning: it is a
    cache, its images are hashed again."""

    def __init__(self, store: Location, max_rows: int) -> None:
        from imgest.storage.cache import local_copy

        self.store, self.folder = store, scratch_folder(self, "hashes")
        self.names = sorted(n for n in store.list_names(PREFIX) if n.endswith(".parquet"))
        self.files: list[str] = []
        for name in self.names:
            try:
                path = local_copy(store, f"{PREFIX}/{name}", self.folder, checksum=name, suffix=".parquet")
                footer = pq.ParquetFile(path)
                if footer.metadata.num_rows > max_rows:
                    raise RecordError(f"{footer.metadata.num_rows:,} rows, more than the {max_rows:,} expected")
                if footer.schema_arrow != _SCHEMA:
                    raise RecordError(f"columns {footer.schema_arrow.types}, not (string, uint64)")
            except (RecordError, StorageError, ValueError, OSError, pa.ArrowException) as exc:
                logging.getLogger("imgest").warning("%s: %s/%s is not a hash file imgest wrote (%s): skipped",
                                                    store.url, PREFIX, name, exc)
                continue
            self.files.append(path)

    def _sources(self) -> str:
        return "[" + ", ".join(sql_string(f) for f in self.files) + "]"

    def lookup(self, content_hashes: pa.Array) -> pa.Table:
        """The stored hash of each of `content_hashes` that has one (a run's candidates: a few per pair), as a
        table (content_hash, phash): one row per content hash found, in no set order."""
        if not self.files or not len(content_hashes):
            return _SCHEMA.empty_table()
        with scratch_sql(self.folder) as con:
            con.register("wanted", pa.table({"content_hash": pa.array(content_hashes, pa.string())}))
            found = con.sql(f"""SELECT content_hash, any_value(phash) AS phash FROM read_parquet({self._sources()})
                                SEMI JOIN wanted USING (content_hash) GROUP BY content_hash""").to_arrow_table()
        return found.cast(_SCHEMA)

    def write(self, new: pa.Table, live: str, run: str) -> None:
        """Every hash so far and `new` (content_hash, phash), kept for the content hashes in `live` (a Parquet
        file with a content_hash column: the images live now), in one new file; then the older files go (a kill
        between leaves both, which read as their union)."""
        added = new.select(["content_hash", "phash"]).cast(_SCHEMA)
        stored = f"SELECT content_hash, phash FROM read_parquet({self._sources()}) UNION ALL " if self.files else ""
        path = os.path.join(self.folder, f"{run}.parquet")
        with scratch_sql(self.folder) as con:
            con.register("added", added)
            con.execute(f"CREATE VIEW live AS SELECT content_hash FROM read_parquet({sql_string(live)})")
            con.execute(f"""COPY (SELECT content_hash, any_value(phash) AS phash
                                  FROM ({stored}SELECT content_hash, phash FROM added)
                                  SEMI JOIN live USING (content_hash) GROUP BY content_hash)
                            TO {sql_string(path)} (FORMAT parquet, COMPRESSION zstd)""")
        self.store.put_file(f"{PREFIX}/{run}.parquet", path)
        for name in self.names:
            if name != f"{run}.parquet":
                self.store.delete(f"{PREFIX}/{name}")
