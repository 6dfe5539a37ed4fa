"""List a catalogue through fsspec and keep the image files, counting what is skipped. The listing is written
to a local Parquet file in batches as it is listed (never one Python object per object kept, never the whole
listing in memory), which the planner joins columnar."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from imgest.scratch import scratch_folder
from imgest.storage import Location, ObjectInfo, StorageError, open_location, redact

# key: as listed (a local name that is not valid UTF-8 is stored with backslash escapes, key_ok false)
LISTING_SCHEMA = pa.schema([("key", pa.string()), ("key_ok", pa.bool_()), ("size", pa.int64()),
                            ("mtime", pa.float64()), ("etag", pa.string()), ("storage_class", pa.string())])
BATCH_ROWS = 65_536


def printable_key(key: str) -> str:
    """The key itself, or for a name that is not valid UTF-8 (a local file system hands those over with
    surrogate escapes) a printable stand-in that can be stored and shown."""
    try:
        key.encode("utf-8")
        return key
    except UnicodeEncodeError:
        return key.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def listing_batches(objects: Iterable[ObjectInfo]) -> Iterator[pa.RecordBatch]:
    """Objects -> LISTING_SCHEMA batches of BATCH_ROWS (at least one, maybe empty)."""
    rows: list[tuple] = []

    def batch() -> pa.RecordBatch:
        columns = list(zip(*rows)) if rows else [[] for _ in LISTING_SCHEMA]
        rows.clear()
        return pa.record_batch([pa.array(c, f.type) for c, f in zip(columns, LISTING_SCHEMA)], schema=LISTING_SCHEMA)

    sent = False
    for obj in objects:
        key = printable_key(obj.key)
        rows.append((key, key == obj.key, obj.size, obj.mtime, obj.etag, obj.storage_class))
        if len(rows) == BATCH_ROWS:
            sent = True
            yield batch()
    if rows or not sent:
        yield batch()


def listing_table(objects: Iterable[ObjectInfo]) -> pa.Table:
    """Objects -> LISTING_SCHEMA, in memory (small listings: text listings, tests)."""
    return pa.Table.from_batches(list(listing_batches(objects)), LISTING_SCHEMA)


class SpillFolder:
    """A folder on local disk for a listing's files; removed with the last object holding it."""

    def __init__(self) -> None:
        self.path = scratch_folder(self, "listing")

    def write(self, name: str, batches: Iterable[pa.RecordBatch]) -> str:
        path = os.path.join(self.path, name)
        with pq.ParquetWriter(path, LISTING_SCHEMA, compression="zstd") as writer:
            for batch in batches:
                writer.write_batch(batch)
        return path


IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".jpe", ".png", ".gif", ".webp", ".bmp", ".tif", ".tiff"})


@dataclass
class Listing:
    catalogue: str
    table: pa.Table | None = None  # LISTING_SCHEMA in key order, for a listing held in memory; else `files`
    skipped: int = 0  # not an image by its extension
    skipped_examples: list[str] = field(default_factory=list)
    not_regular: int = 0  # FIFOs, devices, sockets, dangling links: never read (a read could block for ever)
    not_regular_examples: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)  # local Parquet files (LISTING_SCHEMA), as the parts listed them
    spill: list[SpillFolder] = field(default_factory=list, repr=False)  # keeps the files' folders while needed

    @property
    def source(self) -> pa.Table | list[str]:
        """What the planner joins: the table, or the files (DuckDB streams them)."""
        return self.files if self.table is None else self.table

    def read(self) -> pa.Table:
        """The whole listing in memory, in key order (small consumers only)."""
        if self.table is not None:
            return self.table
        return pa.concat_tables([pq.read_table(f) for f in self.files], promote_options="none").sort_by("key") \
            if self.files else LISTING_SCHEMA.empty_table()

    def __len__(self) -> int:
        return len(self.table) if self.table is not None else sum(pq.read_metadata(f).num_rows for f in self.files)

    @property
    def keys(self) -> list[str]:
        return self.read()["key"].to_pylist()

    @property
    def objects(self) -> list[ObjectInfo]:
        """The listed objects one by one, for the small consumers (query-set builders, text listings)."""
        return [ObjectInfo(r["key"], r["size"], r["mtime"], r["etag"], storage_class=r["storage_class"])
                for r in self.read().to_pylist()]


def is_image_key(key: str) -> bool:
    """An image by the suffix of its name, as the inventory's reader decides it (a name that is only the
    suffix, `shoes/.png`, included: S3 has no hidden files)."""
    return posixpath.basename(key).lower().endswith(_SUFFIXES)


_SUFFIXES = tuple(IMAGE_EXTENSIONS)


def list_catalogue(catalogue_url: str, folder: str = "", maxdepth: int | None = None) -> Listing:
    """Every image object below the catalogue root (or below `folder` in it, `maxdepth` levels down); the item
    id is its key relative to the root."""
    loc: Location = open_location(catalogue_url, must_exist=True, what="catalogue", follow_links=True)
    listing = Listing(catalogue=loc.url, spill=[SpillFolder()])
    above = f"{folder}/" if folder else ""

    def images() -> Iterable[ObjectInfo]:
        for obj in loc.walk(folder, maxdepth):
            key = above + obj.key
            if not obj.regular:
                listing.not_regular += 1
                if len(listing.not_regular_examples) < 10:
                    listing.not_regular_examples.append(key)
            elif is_image_key(key):
                yield ObjectInfo(key, obj.size, obj.mtime, obj.etag, storage_class=obj.storage_class)
            else:
                listing.skipped += 1
                if len(listing.skipped_examples) < 10:
                    listing.skipped_examples.append(key)

    listing.files = [listing.spill[0].write("listing.parquet", listing_batches(images()))]
    return listing


def catalogue_parts(catalogue_url: str) -> list[str]:
    """How a listing fans out: one part per top-level folder (one LIST each, run side by side)."""
    return open_location(catalogue_url, must_exist=True, what="catalogue", follow_links=True).folders()


def merge_listings(parts: list[Listing]) -> Listing:
    """The parts as one listing (their files, or for listings in memory their tables in key order); their counts
    summed."""
    merged = Listing(catalogue=parts[0].catalogue)
    if all(p.table is None for p in parts):
        merged.files = [f for p in parts for f in p.files]
        merged.spill = [s for p in parts for s in p.spill]
    else:
        merged.table = pa.concat_tables([p.read() for p in parts]).sort_by("key").combine_chunks()
    for part in parts:
        merged.skipped += part.skipped
        merged.not_regular += part.not_regular
        merged.skipped_examples = (merged.skipped_examples + part.skipped_examples)[:10]
        merged.not_regular_examples = (merged.not_regular_examples + part.not_regular_examples)[:10]
    return merged


def check_apart(catalogue: Location, store: Location) -> None:
    """Refuse a store inside its own catalogue (or the reverse): its files would be listed as images."""
    a, b = catalogue.uri().rstrip("/") + "/", store.uri().rstrip("/") + "/"
    if b.startswith(a) or a.startswith(b):
        raise StorageError(f"store {redact(store.url)} and catalogue {redact(catalogue.url)} overlap: the store's "
                           "own files would be listed as catalogue images; put the store outside the catalogue")
