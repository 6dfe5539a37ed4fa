"""A version's id map (faiss id -> item_id, uri, content_hash): written to a file from DuckDB by a build or an
update, and opened for lookups memory-mapped, so that neither side holds an object per catalogue item."""

from __future__ import annotations

import bisect
import contextlib
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from imgest.scratch import scratch_folder
from imgest.storage import parquet_reader

ID_MAP_SCHEMA = pa.schema([("faiss_id", pa.int64()), ("item_id", pa.string()), ("uri", pa.string()),
                           ("content_hash", pa.string()), ("shard", pa.string())])  # shard: where its vector is
ID_MAP_BATCH = 65_536  # rows numbered, checked and written at a time


class IdMapFile:
    """A version's id map (faiss_id, item_id, uri, content_hash, in faiss id order) as a Parquet file on local
    disk, removed with this object: a build or an update writes it from DuckDB and the version uploads the file,
    so the N rows of a large catalogue never sit in the flow's memory."""

    def __init__(self, rows: int = 0) -> None:
        self.path = os.path.join(scratch_folder(self, "ids"), "ids.parquet")
        self.rows = rows  # set by the writer

    def __len__(self) -> int:
        return self.rows

    def number(self, ordered: str, skip: np.ndarray | None = None) -> IdMapFile:
        """Write the map from `ordered`, a Parquet file of (item_id, uri, content_hash, shard) in item_id order (as
        DuckDB's external sort writes it): faiss id = position, as a fresh build numbers its vectors. Rows at the
        positions in `skip` (sorted) are left out and the rest numbered without gaps. The order is checked as it
        goes: ids out of order would silently pair vectors with the wrong items."""
        skip = np.asarray([] if skip is None else skip, np.int64)
        last, position = None, 0
        with pq.ParquetWriter(self.path, ID_MAP_SCHEMA, compression="zstd") as writer:
            for batch in parquet_reader(ordered).iter_batches(ID_MAP_BATCH, columns=ID_MAP_SCHEMA.names[1:]):
                keys = batch.column(0)
                if len(keys) and ((last is not None and keys[0].as_py() <= last) or
                                  pc.any(pc.less_equal(keys[1:], keys[:-1])).as_py()):
                    raise RuntimeError("the live items did not come back in item_id order")
                last = keys[-1].as_py() if len(keys) else last
                here = np.arange(position, position + len(batch))
                position += len(batch)
                if len(skip):
                    batch = batch.filter(pa.array(~np.isin(here, skip)))
                numbers = pa.array(np.arange(self.rows, self.rows + len(batch)), pa.int64())
                writer.write_batch(pa.record_batch([numbers, *batch.columns], schema=ID_MAP_SCHEMA))
                self.rows += len(batch)
        return self


class IdMap:
    """A written version's id map opened for lookups by faiss id: its item_id and uri columns memory-mapped from
    an uncompressed Arrow copy of the checked Parquet file, made once per checksum in the index cache. A lookup
    reads the pages of the rows it asks for and no more (`mapped`); what stays resident is those pages (clean,
    given back under pressure), never a string per item on the heap."""

    def __init__(self, parquet: str, sha256: str, cache_dir: str) -> None:
        self.parquet = parquet  # the checked file itself (DuckDB joins read it)
        self.sha256 = sha256
        path = os.path.join(cache_dir, f"ids-{sha256}.arrow")
        if not os.path.exists(path):
            os.makedirs(cache_dir, exist_ok=True)  # a local store copies nothing else there: the first search makes it
            _to_arrow_file(parquet, path)
        self.file = MappedFile(path)
        reader = pa.ipc.open_file(pa.BufferReader(self.file.buffer))
        table = reader.read_all()
        self.item_ids, self.uris = table["item_id"], table["uri"]
        # the shard each vector was read from (maps written before it was recorded have none)
        self.shards = table["shard"] if "shard" in table.column_names else None
        self.ordered = (reader.schema.metadata or {}).get(ORDERED) == b"true"
        self._starts = np.cumsum([0] + [len(chunk) for chunk in self.item_ids.chunks])  # a batch's first row

    def __len__(self) -> int:
        return len(self.item_ids)

    def items(self, rows: np.ndarray) -> list[str]:
        """The item ids of faiss ids `rows` (each in 0..len-1)."""
        return self.take(self.item_ids, rows)

    def uris_of(self, rows: np.ndarray) -> list[str]:
        """The catalogue uris of faiss ids `rows`."""
        return self.take(self.uris, rows)

    def take(self, column: pa.ChunkedArray, rows: np.ndarray) -> list:
        """`column`'s values at `rows` as Python values (see `take_array`)."""
        return self.take_array(column, rows).to_pylist()

    def take_array(self, column: pa.ChunkedArray, rows: np.ndarray) -> pa.Array:
        """`column`'s values at `rows`, in that order (`take_rows`)."""
        return take_rows(column, self._starts, rows)

    def uri(self, row: int) -> str:
        return self.uris[int(row)].as_py()

    def shard(self, row: int) -> str | None:
        return None if self.shards is None else self.shards[int(row)].as_py()

    def position(self, item_id: str) -> int | None:
        """The faiss id of `item_id`; None when the version does not hold it. A binary search: builds and updates
        number in item_id order (checked when the map was converted); a map that is not is scanned instead."""
        if not self.ordered:
            found = pc.index(self.item_ids, item_id).as_py()
            return None if found is None or found < 0 else found
        return find_sorted(self.item_ids, item_id)

    def positions(self, item_ids: list[str]) -> np.ndarray:
        """`position` of each, -1 for those the version does not hold."""
        return np.asarray([-1 if (p := self.position(i)) is None else p for i in item_ids], np.int64)


class MappedFile:
    """A file memory-mapped read-only for random reads: a lookup keeps resident the pages it reads, not their
    neighbours. Two things brought neighbours: the kernel's readahead on a fault (8 MB on the development
    machine's disk; MADV_RANDOM turns it off), and pages already cached from the file's writing, which the kernel
    keeps in large pieces and maps whole on a fault (512 kB a lookup, measured): those are written out and let go
    first (pages another process maps stay). At 10M items a served version's id map and metadata file otherwise
    grew resident towards their whole size within a few hundred queries (2.1 GB of file pages). A scan of whole
    columns asks for them ahead (`will_scan`): page by page, a filter's first pass over 10M rows took 2.2 s."""

    def __init__(self, path: str) -> None:
        import mmap

        with open(path, "rb") as fh:
            # advice only: a filesystem that refuses it (read-only, remote) still serves the file, as before
            with contextlib.suppress(OSError, AttributeError):
                os.fdatasync(fh.fileno())
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            self._view = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
        if hasattr(self._view, "madvise"):
            self._view.madvise(mmap.MADV_RANDOM)
        self.buffer = pa.py_buffer(self._view)

    def will_scan(self, column: pa.ChunkedArray) -> None:
        """Read `column` (of a table read from this file) ahead of a scan, in the background (MADV_WILLNEED)."""
        import mmap

        if not hasattr(self._view, "madvise"):
            return
        base, size = self.buffer.address, self.buffer.size
        for chunk in column.chunks:
            for part in chunk.buffers():
                if part is None or not part.size or not base <= part.address < base + size:
                    continue
                start = (part.address - base) // mmap.PAGESIZE * mmap.PAGESIZE
                self._view.madvise(mmap.MADV_WILLNEED, start, min(part.address - base + part.size, size) - start)


def take_rows(column: pa.ChunkedArray, starts: np.ndarray, rows: np.ndarray) -> pa.Array:
    """`column`'s values at `rows`, in that order, each read from its own batch of a mapped file (`starts`: each
    batch's first row, then the row count). A take on the whole chunked column joins every batch into one array
    first: measured at 10M items, 430 MB of Arrow memory and 150 ms for the 10 hits of one query."""
    rows = np.asarray(rows, np.int64)
    order = np.argsort(rows, kind="stable")
    ascending = rows[order]
    batch = np.searchsorted(starts, ascending, side="right") - 1
    edges = [0, *(np.flatnonzero(np.diff(batch)) + 1), len(rows)]
    parts = [column.chunk(int(batch[a])).take(pa.array(ascending[a:b] - starts[batch[a]]))
             for a, b in zip(edges, edges[1:]) if b > a]
    taken = pa.concat_arrays(parts) if parts else pa.array([], column.type)
    return taken.take(pa.array(np.argsort(order, kind="stable")))  # back to the order asked for


def find_sorted(column: pa.ChunkedArray, key: str) -> int | None:
    """The row of `key` in a string column in ascending order, by halves (one row read per step); None when it
    is not there."""
    at = bisect.bisect_left(_Column(column), key)
    return at if at < len(column) and column[at].as_py() == key else None


def ascending(column: pa.ChunkedArray) -> bool:
    """Every value greater than the one before, no nulls (vectorised)."""
    if len(column) < 2:
        return not column.null_count
    return not column.null_count and not pc.any(pc.less_equal(column.slice(1), column.slice(0, len(column) - 1))
                                                ).as_py()


class _Column:
    """A string column as the sequence bisect searches (one row read per step)."""

    def __init__(self, column: pa.ChunkedArray) -> None:
        self.column = column

    def __len__(self) -> int:
        return len(self.column)

    def __getitem__(self, row: int) -> str:
        return self.column[row].as_py()


ORDERED = b"imgest.ordered"  # the Arrow copy's metadata: every item_id is greater than the one before


def _ordered(source: pq.ParquetFile) -> bool:
    """Every item_id greater than the one before (no nulls), checked a batch at a time."""
    last = None
    for batch in source.iter_batches(ID_MAP_BATCH, columns=["item_id"]):
        keys = batch.column(0)
        if not len(keys):
            continue
        if keys.null_count or (last is not None and keys[0].as_py() <= last) or \
                pc.any(pc.less_equal(keys[1:], keys[:-1])).as_py():
            return False
        last = keys[-1].as_py()
    return True


def _to_arrow_file(parquet: str, path: str) -> None:
    """Stream the Parquet map's item_id, uri (and shard) columns into an Arrow IPC file (uncompressed: it maps as is),
    with whether its ids are in order; written beside its final name and renamed into place, so a reader never
    maps half a file."""
    temp = f"{path}.{os.getpid()}.tmp"
    source = parquet_reader(parquet)
    columns = [name for name in ("item_id", "uri", "shard") if name in source.schema_arrow.names]
    schema = pa.schema([source.schema_arrow.field(name) for name in columns],
                       metadata={ORDERED: b"true" if _ordered(source) else b"false"})
    with pa.OSFile(temp, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for batch in source.iter_batches(ID_MAP_BATCH, columns=columns):
            writer.write_batch(pa.record_batch(batch.columns, schema=schema))
    os.replace(temp, path)


class NotInOrder(Exception):
    """An id map whose item ids do not ascend (written before maps were numbered in item_id order)."""


def merged_remap(previous: str, ordered: str, rows: int) -> np.ndarray:
    """previous faiss id -> row of `ordered` (-1: the vector left), the same item with the same content being the
    same vector. `previous` is an id map of `rows` rows, `ordered` a file of (item_id, content_hash) rows, both in
    item_id order: merged a batch at a time, so what is held is the result (one int64 per previous vector) and a
    batch of each file, however large the catalogue, never a join of N rows by N. NotInOrder when the previous
    map's ids do not ascend (a map written before maps were numbered in item_id order); `ordered` is checked by
    whoever numbers it."""
    remap = np.full(rows, -1, np.int64)
    later = _positioned(ordered)
    window = pa.table({"item_id": pa.array([], pa.string()), "content_hash": pa.array([], pa.string()),
                       "row": pa.array([], pa.int64())})
    done, last = False, None
    for batch in parquet_reader(previous).iter_batches(ID_MAP_BATCH, columns=["faiss_id", "item_id", "content_hash"]):
        keys = batch.column(1).cast(pa.string())
        if not len(keys):
            continue
        if keys.null_count or (last is not None and keys[0].as_py() <= last) or \
                pc.any(pc.less_equal(keys[1:], keys[:-1])).as_py():
            raise NotInOrder(f"{previous}: item ids out of order")
        last = keys[-1].as_py()
        # the other file's rows up to this batch's last key (both ascend: no later previous row can match them)
        while not done and (not len(window) or window["item_id"][-1].as_py() <= last):
            try:
                window = pa.concat_tables([window, next(later)])
            except StopIteration:
                done = True
        at = pc.index_in(keys, value_set=window["item_id"])
        found = pc.is_valid(at).to_numpy(zero_copy_only=False)
        if found.any():
            taken = pc.fill_null(at, 0).to_numpy(zero_copy_only=False).astype(np.int64)
            hashes = pc.fill_null(window["content_hash"], "").take(pa.array(taken))
            found &= pc.equal(pc.fill_null(batch.column(2).cast(pa.string()), ""), hashes).to_numpy(
                zero_copy_only=False)
            remap[batch.column(0).cast(pa.int64()).to_numpy()[found]] = \
                window["row"].take(pa.array(taken[found])).to_numpy()
        window = window.filter(pc.greater(window["item_id"], last))
    return remap


def _positioned(path: str):
    """The file's (item_id, content_hash) as tables of ID_MAP_BATCH rows, with each row's position."""
    start = 0
    for batch in parquet_reader(path).iter_batches(ID_MAP_BATCH, columns=["item_id", "content_hash"]):
        yield pa.table({"item_id": batch.column(0).cast(pa.string()), "content_hash": batch.column(1).cast(pa.string()),
                        "row": pa.array(np.arange(start, start + len(batch)), pa.int64())})
        start += len(batch)
