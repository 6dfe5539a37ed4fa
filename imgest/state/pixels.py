"""Kept pixels in a store: each embedding shard of a model that keeps them has a pixel shard beside it, one row per
image it decoded (item_id, content_hash, width, height, codec, bytes: the copy, imgest/images/kept.py), written
before the shard's commit marker and named in it. So a copy follows its item as the vector does: the state's live
row says which shard holds an item, and that shard's pixel file holds its copy of those bytes; a changed item's
new copy is in its new shard, a deleted item's is tombstoned with its row, a killed run's unreferenced file is
removed with its shard (`remove_orphans`).

    pixels/model=<slug>/side=<SIDE>/<shard>.parquet

A model's setting (keep at SIDE, or not) is recorded in `state/model=<slug>/kept-pixels.json` and kept by later
runs; a new model in a store takes the setting of the model whose copies it reads.

What is read back is untrusted: a pixel file is read only through a live row of the state, its rows must carry
the item's content hash, and its sizes are checked (the footer's row groups, each copy's bytes, the image's
declared pixels when decoded) before memory is spent; a file that is damaged, planted or oversized is skipped
with a warning and its items read from the catalogue (`KeptPixelsError`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from imgest.images import kept
from imgest.state import layout
from imgest.state.clock import now_iso
from imgest.state.layout import kept_setting_key as setting_key
from imgest.state.layout import pixels_key, pixels_prefix
from imgest.storage import Location, StorageError
from imgest.storage.conditional import TEMP_PREFIX

SCHEMA = pa.schema([("item_id", pa.string()), ("content_hash", pa.string()), ("width", pa.int32()),
                    ("height", pa.int32()), ("codec", pa.string()), ("bytes", pa.binary())])
ROW_GROUP = 256  # copies a row group at most (~17 MB at side 256), what a reader holds at a time ...
GROUP_BYTES = 16 << 20  # ... or fewer, once their bytes reach this (a large side)
MAX_GROUP_BYTES = 4 * GROUP_BYTES  # a row group's size in the footer above this: not written by imgest
MIN_SIDE, MAX_SIDE = 32, 4096
# a column's encodings in a pixel file: values PLAIN, levels RLE. A dictionary or delta encoding (or compression)
# lets a small row group decode to any size (one 4 MB value repeated 1,024 times is a 61 kB file whose footer
# says 1 MB), so the footer's sizes would bound nothing
PLAIN_ONLY = frozenset({"PLAIN", "RLE", "BIT_PACKED"})


class KeptPixelsError(ValueError):
    """A pixel file that cannot be trusted or read (damaged, planted, oversized): its items come from the catalogue."""


def check_side(side: int) -> int:
    if not MIN_SIDE <= side <= MAX_SIDE:
        raise ValueError(f"keep_pixels: a side from {MIN_SIDE} to {MAX_SIDE} pixels, or 0 (off); got {side}")
    return side


def read_setting(store: Location, slug: str) -> int | None:
    """The side a model keeps copies at (0: recorded off), None when nothing is recorded; a record that is not
    one of ours counts as none."""
    try:
        value = store.read_json(setting_key(slug))
        side = value["side"]
        if not isinstance(side, int) or isinstance(side, bool) or not (side == 0 or MIN_SIDE <= side <= MAX_SIDE):
            return None
    except (FileNotFoundError, KeyError, TypeError, ValueError, StorageError):
        return None
    return side


def record_setting(store: Location, slug: str, side: int, run_id: str, source: str) -> None:
    if read_setting(store, slug) != side:
        store.write_json(setting_key(slug), {"side": side, "codec": kept.CODEC, "quality": kept.QUALITY,
                                             "run_id": run_id, "source": source, "recorded": now_iso()})


def keep_side(store: Location, slug: str, asked: int | None, source_slug: str | None, run_id: str) -> int:
    """The side this run of `slug` keeps copies at (0: none), recorded when it changes: `asked` (the option), else
    the model's recorded setting, else the setting of the model it reads copies from."""
    if asked is not None:
        side = check_side(asked) if asked else 0
        record_setting(store, slug, side, run_id, "asked")
        return side
    own = read_setting(store, slug)
    if own is not None:
        return own
    inherited = read_setting(store, source_slug) if source_slug else None
    if inherited:
        record_setting(store, slug, inherited, run_id, f"taken from model={source_slug}")
        return inherited
    return 0


def kept_shards(store: Location, slug: str) -> pa.Table:
    """The shards of `slug` that have a pixel file, and its side: (shard, side), from a listing (a name that is not
    one of ours is left out)."""
    shards, sides = [], []
    for folder in store.list_names(pixels_prefix(slug)):
        if not (m := SIDE_FOLDER.fullmatch(folder)) or not MIN_SIDE <= int(m.group(1)) <= MAX_SIDE:
            continue
        for name in store.list_names(layout.file_in(pixels_prefix(slug), folder)):
            if name.endswith(".parquet"):
                shards.append(name[:-len(".parquet")])
                sides.append(int(m.group(1)))
    return pa.table({"shard": pa.array(shards, pa.string()), "side": pa.array(sides, pa.int32())})


def models_keeping(store: Location) -> list[str]:
    """Slugs with a pixel folder in the store."""
    return [name.removeprefix(layout.MODEL) for name in store.list_names(layout.PIXELS)
            if name.startswith(layout.MODEL)]


class PixelShardWriter:
    """One shard's copies, written as they come to a local file (ROW_GROUP rows at a time), uploaded by `publish`
    before the shard's commit marker."""

    def __init__(self, side: int):
        from imgest.scratch import scratch_folder

        self.side, self.rows, self.copy_bytes, self._held_bytes = side, 0, 0, 0
        self.path = os.path.join(scratch_folder(self, "pixels"), "pixels.parquet")
        footer = {b"imgest.side": str(side).encode(), b"imgest.codec": kept.CODEC.encode(),
                  b"imgest.quality": str(kept.QUALITY).encode()}
        # JPEG bytes do not compress; plain values, so the footer's sizes are what a reader decodes (PLAIN_ONLY)
        self._writer = pq.ParquetWriter(self.path, SCHEMA.with_metadata(footer), compression="none",
                                        use_dictionary=False)
        self._held: list[tuple[str, str, int, int, bytes]] = []

    def add(self, item_id: str, content_hash: str, width: int, height: int, data: bytes) -> None:
        self._held.append((item_id, content_hash, width, height, data))
        self.rows += 1
        self.copy_bytes += len(data)
        self._held_bytes += len(data)
        if len(self._held) >= ROW_GROUP or self._held_bytes >= GROUP_BYTES:
            self._flush()

    def _flush(self) -> None:
        if self._held:
            ids, hashes, widths, heights, datas = zip(*self._held)
            self._writer.write_table(pa.table([list(ids), list(hashes), pa.array(widths, pa.int32()),
                                               pa.array(heights, pa.int32()), [kept.CODEC] * len(ids), list(datas)],
                                              schema=SCHEMA))
            self._held, self._held_bytes = [], 0

    def publish(self, store: Location, slug: str, shard: str) -> dict | None:
        """Upload the file (whole or not at all) and say what it holds, for the commit marker; None without rows."""
        self._flush()
        self._writer.close()
        if not self.rows:
            return None
        key = pixels_key(slug, self.side, shard)
        store.put_file(key, self.path)
        return {"file": key, "side": self.side, "codec": kept.CODEC, "quality": kept.QUALITY, "rows": self.rows,
                "bytes": os.path.getsize(self.path)}


@dataclass(frozen=True)
class KeptCopy:
    item_id: str
    content_hash: str
    data: bytes


def read_copies(store: Location, slug: str, side: int, shard: str, wanted: dict[str, str]) -> Iterator[KeptCopy]:
    """The copies of `wanted` (item_id -> the content hash the live row says) in one pixel file, a row group at a
    time, in the file's order. Rows of other items or other bytes are passed over; a file that is not one of ours
    (schema, sizes) raises KeptPixelsError before any copy is read, one that breaks while read raises it then."""
    key = pixels_key(slug, side, shard)
    try:
        with store.parquet_file(key) as file:
            if not file.schema_arrow.remove_metadata().equals(SCHEMA):
                raise KeptPixelsError(f"{key}: not a pixel file (schema {file.schema_arrow.names})")
            meta = file.metadata
            for group in range(meta.num_row_groups):
                chunks = [meta.row_group(group).column(c) for c in range(meta.row_group(group).num_columns)]
                if any(c.compression != "UNCOMPRESSED" or not set(c.encodings) <= PLAIN_ONLY for c in chunks):
                    raise KeptPixelsError(f"{key}: row group {group} is compressed or dictionary- or delta-encoded; "
                                          "imgest writes pixel files plain")
                size = meta.row_group(group).total_byte_size
                if size > MAX_GROUP_BYTES or meta.row_group(group).num_rows > 4 * ROW_GROUP:
                    raise KeptPixelsError(f"{key}: row group {group} of {size:,} bytes, "
                                          f"{meta.row_group(group).num_rows} rows: larger than imgest writes")
            for group in range(meta.num_row_groups):
                ids = file.read_row_group(group, columns=["item_id", "content_hash"])
                mine = pc.is_in(ids["item_id"], value_set=pa.array(list(wanted), pa.string()))
                if not pc.any(mine).as_py():
                    continue
                table = file.read_row_group(group, columns=["item_id", "content_hash", "bytes"]).filter(mine)
                for item_id, content_hash, data in zip(table["item_id"].to_pylist(),
                                                       table["content_hash"].to_pylist(), table["bytes"].to_pylist()):
                    if wanted.get(item_id) == content_hash and data and len(data) <= kept.MAX_COPY_BYTES:
                        yield KeptCopy(item_id, content_hash, data)
    except KeptPixelsError:
        raise
    except FileNotFoundError as exc:
        raise KeptPixelsError(f"{key}: missing") from exc
    except (OSError, pa.ArrowException, StorageError, ValueError) as exc:
        raise KeptPixelsError(f"{key}: {type(exc).__name__}: {exc}") from exc


def coverage(store: Location, slug: str, state) -> dict:
    """What a model keeps: its setting, the live items whose shard has a copy, and the pixel files' bytes."""
    files = [(info.key, info.size) for info in store.walk(pixels_prefix(slug))]
    kept_table = kept_shards(store, slug)
    covered = 0
    if len(kept_table) and state is not None:
        with state.sql() as cur:
            cur.register("kept_shards", kept_table)
            covered = cur.execute("""SELECT count(*) FROM state s SEMI JOIN kept_shards k ON k.shard = s.shard
                                     WHERE s.status = 'live'""").fetchall()[0][0]
            cur.unregister("kept_shards")
    sides = sorted(set(kept_table["side"].to_pylist()))
    return {"side": read_setting(store, slug), "live_items": covered, "files": len(files),
            "bytes": sum(size for _, size in files), "sides": sides}


SIDE_FOLDER = re.compile(r"side=(\d{1,4})")


def remove_orphans(store: Location, slug: str, needed: set[str]) -> list[str]:
    """Delete pixel files whose shard no committed state refers to (`needed`), and temp files of a killed write."""
    removed = []
    for folder in store.list_names(pixels_prefix(slug), temp=True):
        if not SIDE_FOLDER.fullmatch(folder):
            continue
        side = layout.file_in(pixels_prefix(slug), folder)
        for name in store.list_names(side, temp=True):
            stem = name[:-len(".parquet")] if name.endswith(".parquet") else None
            if name.startswith(TEMP_PREFIX) or (stem and stem not in needed):
                store.delete(layout.file_in(side, name))
                removed.append(f"{folder}/{name}")
    return removed
