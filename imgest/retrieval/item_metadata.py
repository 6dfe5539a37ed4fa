"""The catalogue metadata of an index version's items, for serving: one row per faiss id, in faiss id order, in an
uncompressed Arrow file on local disk that is memory-mapped, never loaded.

Made once per (version's id map, metadata snapshot) in the index cache: the version's id map merged with the
store's latest snapshot on item_id, a batch at a time (both are in its order), then sorted by faiss id by DuckDB
on disk (memory capped, spilling). A hit's metadata is then a read of
its rows' pages; a `--where` is DuckDB over the columns it names (the file's other columns are never read);
`--group-by` reads one column at the hits' rows; the columns a search page offers are worked out while the file
is made and kept in its schema, so serving them scans nothing. What stays resident is what the OS keeps of the
file (clean pages, given back under pressure), not the snapshot's width times the catalogue.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from imgest.retrieval.idmap import IdMap, MappedFile, take_rows
from imgest.state.metadata import NotInOrder, latest_seq, snapshot_key, write_merged
from imgest.state.rows import sql_name, sql_string
from imgest.storage import Location
from imgest.storage.cache import local_copy

FAISS_ID = "_faiss_id"  # the row's faiss id (a filter selects these)
PRESENT = "_has_row"  # whether the item has a metadata row (a row of nulls otherwise)
INTERNAL = frozenset({FAISS_ID, PRESENT, "row_hash"})
COLUMNS_KEY = b"imgest.columns"  # the schema metadata: the columns a search page offers (describe_columns)
FORMAT = "1"  # the file's layout: a change makes a new file beside the old ones
BUILD_MEMORY = "256MB"  # DuckDB's cap while it joins and sorts; past it, it spills to the file's folder
BATCH = 2_048  # rows per record batch of the file: what a hit's row costs to read (~1 MB of product text)
MAX_CHOICES = 50  # a text column with at most this many values is a choice on the search page


class VersionMetadata:
    """An index version's items' metadata rows, by faiss id (module docstring)."""

    def __init__(self, store: Location, ids: IdMap, cache_dir: str) -> None:
        seq = latest_seq(store)
        if not seq:
            raise LookupError(f"{store.url} holds no catalogue metadata")
        key = f"{ids.sha256}\n{store.uri(snapshot_key(seq))}\n{seq}\n{FORMAT}"
        path = os.path.join(cache_dir, f"metadata-{hashlib.sha256(key.encode()).hexdigest()[:32]}.arrow")
        self.seq, self.path = seq, path
        opened = None
        if os.path.exists(path):
            with contextlib.suppress(OSError):  # opened: kept by `_sweep` (a read-only cache keeps everything)
                os.utime(path)
            try:
                opened = _open(path, len(ids))
            except (OSError, ValueError, pa.ArrowException) as exc:  # damaged: made again
                logging.getLogger("imgest").warning("%s is not a whole metadata file (%s): made again", path, exc)
        if opened is None:
            os.makedirs(cache_dir, exist_ok=True)
            snapshot = local_copy(store, snapshot_key(seq), os.path.join(cache_dir, "snapshots"), checksum=str(seq),
                                  suffix=".parquet")
            _write(ids.parquet, snapshot, path)
            _sweep(cache_dir, keep=path)
            opened = _open(path, len(ids))
        self.file, self.table, schema = opened
        self.columns: list[dict] = json.loads((schema.metadata or {}).get(COLUMNS_KEY, b"[]"))
        self.names = [n for n in self.table.column_names if n not in INTERNAL]
        self._starts = np.cumsum([0] + [batch.num_rows for batch in self.table.to_batches()])
        self._file = pa.ipc.open_file(pa.OSFile(path))  # the rows of hits: read, not mapped (`rows`)

    def __len__(self) -> int:
        return self.table.num_rows

    def rows(self, faiss_ids: np.ndarray) -> list[dict | None]:
        """Each faiss id's metadata row as a dict (None where its item has none), in the order asked. Read from
        the file (pread) a record batch at a time, not through the mapping: a mapped page the OS has in its
        cache comes with its neighbours (fault-around), so reading a few rows of every column through the
        mapping left ~1.5 MB resident per row read, and a served version's resident pages grew to the whole file
        within a few hundred queries. Here what a query reads is its hits' batches, and it is freed after."""
        faiss_ids = np.asarray(faiss_ids, np.int64)
        batch_of = np.searchsorted(self._starts, faiss_ids, side="right") - 1
        found: dict[int, dict | None] = {}
        for batch in np.unique(batch_of):
            table = pa.Table.from_batches([self._file.get_batch(int(batch))]).select([PRESENT, *self.names])
            for at in faiss_ids[batch_of == batch]:
                row = table.slice(int(at - self._starts[batch]), 1).to_pylist()[0]
                found[int(at)] = row if row.pop(PRESENT) else None
        return [found[int(at)] for at in faiss_ids]

    def with_rows(self, faiss_ids: np.ndarray) -> np.ndarray:
        """Those of `faiss_ids` whose items have a metadata row (a filter matches rows, as it did over the
        snapshot: `category IS NULL` is not every item without metadata)."""
        present = take_rows(self.table.column(PRESENT), self._starts, faiss_ids)
        return faiss_ids[present.to_numpy(zero_copy_only=False)]

    def value(self, name: str, faiss_id: int):
        """One row's value of one column (None for none)."""
        return self.table.column(name)[int(faiss_id)].as_py()


def _open(path: str, rows: int) -> tuple[MappedFile, pa.Table, pa.Schema]:
    """The file (mapped), its table and schema; ValueError when it does not hold `rows` rows."""
    file = MappedFile(path)
    reader = pa.ipc.open_file(pa.BufferReader(file.buffer))
    table = reader.read_all()
    if table.num_rows != rows or FAISS_ID not in table.column_names or PRESENT not in table.column_names:
        raise ValueError(f"{table.num_rows} rows of {table.column_names}, for the version's {rows} items")
    return file, table, reader.schema


UNUSED_DAYS = 7  # a metadata file no searcher has opened for this long is removed when another is made


def _sweep(cache_dir: str, keep: str) -> None:
    """Remove the metadata files (and the snapshot copies they were made from) not opened for UNUSED_DAYS: each
    served version and snapshot makes one as large as the snapshot's rows, and a nightly makes a version a day.
    A process still mapping a removed file keeps reading it (the OS frees it when unmapped)."""
    import glob
    import time

    cutoff = time.time() - UNUSED_DAYS * 86400
    for old in glob.glob(os.path.join(cache_dir, "metadata-*.arrow")) + \
            glob.glob(os.path.join(cache_dir, "snapshots", "*.parquet")):
        with contextlib.suppress(OSError):
            if old != keep and os.path.getmtime(old) < cutoff:
                os.remove(old)


def _write(ids_parquet: str, snapshot: str, path: str) -> None:
    """Merge the id map (faiss_id, item_id) with the snapshot, sort the rows by faiss id, stream them into an
    Arrow file beside `path` and rename it into place (a reader never maps half a file)."""
    import duckdb

    from imgest.scratch import scratch_folder

    names = [n for n in pq.read_schema(snapshot).names if n not in ("item_id", *INTERNAL)]  # ours are reserved
    holder = _Holder()
    folder = scratch_folder(holder, "metadata")
    con = duckdb.connect(config={"memory_limit": BUILD_MEMORY, "threads": 1, "preserve_insertion_order": True,
                                 "temp_directory": os.path.join(folder, "spill")})
    tmp = f"{path}.{uuid.uuid4().hex}.part"
    try:
        con.execute(f"CREATE VIEW snapshot AS SELECT * FROM read_parquet({sql_string(snapshot)})")
        columns = describe(con, names)
        # the id map merged with the snapshot on item_id (both in its order: a map written before maps were
        # ordered is sorted first), then sorted by faiss id apart
        merged = os.path.join(folder, "merged.parquet")
        try:
            write_merged(snapshot, ids_parquet, ["faiss_id", "item_id"], [*names, "row_hash"], merged, BATCH)
        except NotInOrder:
            ordered = os.path.join(folder, "ids.parquet")
            con.execute(f"""COPY (SELECT faiss_id, item_id FROM read_parquet({sql_string(ids_parquet)})
                                  ORDER BY item_id) TO {sql_string(ordered)}
                            (FORMAT parquet, ROW_GROUP_SIZE {BATCH})""")
            write_merged(snapshot, ordered, ["faiss_id", "item_id"], [*names, "row_hash"], merged, BATCH)
        picked = "".join(f", {sql_name(n)}" for n in names)
        reader = con.sql(f"""SELECT faiss_id AS {FAISS_ID}, row_hash IS NOT NULL AS {PRESENT}{picked}
                             FROM read_parquet({sql_string(merged)}) ORDER BY faiss_id""").to_arrow_reader(BATCH)
        schema = reader.schema.with_metadata({COLUMNS_KEY: json.dumps(columns).encode(), b"imgest.format": FORMAT})
        with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            for batch in reader:
                writer.write_batch(batch)
        os.replace(tmp, path)
    finally:
        con.close()
        if os.path.exists(tmp):
            os.remove(tmp)


class _Holder:
    """Owns the scratch folder of one file's making (removed with it)."""


NUMBER_TYPES = ("TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT", "USMALLINT", "UINTEGER",
                "UBIGINT", "FLOAT", "DOUBLE", "DECIMAL", "REAL")


def describe(con, names: list[str], max_values: int = MAX_CHOICES) -> list[dict]:
    """Each metadata column for a search page's filter form, from the view `snapshot`: numbers with their range,
    text with its values when there are at most `max_values` of them (a choice), else none (free text); columns
    that are all null, and nested ones, are left out. One aggregate per column, memory capped by the connection:
    an estimate of the distinct values first (HyperLogLog, a few kB), the values themselves only for a choice."""
    kinds = dict(con.execute("SELECT column_name, column_type FROM (DESCRIBE SELECT * FROM snapshot)").fetchall())
    columns = []
    for name in names:
        kind, q = kinds[name].upper(), sql_name(name)
        if kind.startswith(NUMBER_TYPES):
            (count, low, high), = con.execute(f"SELECT count({q}), min({q}), max({q}) FROM snapshot").fetchall()
            if count:
                columns.append({"name": name, "type": "number", "min": _plain(low), "max": _plain(high)})
            continue
        if any(mark in kind for mark in ("STRUCT", "MAP", "[]", "UNION")) or kind.startswith(("LIST", "BLOB")):
            continue  # nested: not a filter of the form
        (count, estimate), = con.execute(f"SELECT count({q}), approx_count_distinct({q}) FROM snapshot").fetchall()
        if not count:
            continue
        values = None
        if estimate <= 2 * max_values:  # HyperLogLog's error is a few percent: count exactly near the line
            found = [v for (v,) in con.execute(f"SELECT DISTINCT CAST({q} AS VARCHAR) FROM snapshot "
                                               f"WHERE {q} IS NOT NULL LIMIT {max_values + 1}").fetchall()]
            values = sorted(found) if len(found) <= max_values else None
        columns.append({"name": name, "type": "text", "values": values})
    return columns


def _plain(value):
    """A JSON number for a column's bound (DuckDB's DECIMAL comes back as Decimal)."""
    if value is None or isinstance(value, int | float):
        return value
    return float(value)
