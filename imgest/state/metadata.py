"""Catalogue metadata: one row per item beside the images (item_id, product_id, title, caption, attributes).

Read from Parquet, CSV or JSONL (a path or any fsspec URL) block by block (`metadata_file`), assembled by
DuckDB on local disk (types, duplicates of item_id, each row's hash), and kept in the store as immutable
snapshots `metadata/snapshots/<seq>.parquet`, sorted by item_id: a new one is written only when a row changed,
so the nightly costs nothing when the table did not move. The comparison with the last snapshot and with the
catalogue's listing are joins on disk; no step holds a Python object per row, so a 100M-row file is read in
the memory of a block and DuckDB's cap. Rows for items the catalogue does not have, and items without a row,
are counted and reported, never fatal; a malformed file is one error naming its line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from imgest.scratch import scratch_folder
from imgest.state.clock import now_iso
from imgest.state.layout import METADATA_SNAPSHOTS as SNAPSHOTS
from imgest.state.layout import metadata_snapshot_key as snapshot_key
from imgest.state.metadata_file import (
    ID_COLUMNS,
    MAX_BLOCK_BYTES,
    MAX_CELL_CHARS,
    MAX_JSON_DEPTH,
    MAX_LINE_CHARS,
    MAX_METADATA_COLUMNS,
    TEXT_COLUMNS,
    MetadataError,
    Parts,
    read_parts,
)
from imgest.state.rows import ALLOCATOR_FLUSH, one_thread, scratch_sql, sql_name, sql_string
from imgest.storage import Location, parquet_reader, redact
from imgest.storage.cache import local_copy

__all__ = ["MAX_BLOCK_BYTES", "MAX_CELL_CHARS", "MAX_JSON_DEPTH", "MAX_LINE_CHARS", "MAX_METADATA_COLUMNS",
           "MetadataError", "MetadataReport", "NoMetadataError", "StagedMetadata", "latest_seq", "load_metadata",
           "read_metadata", "snapshot_file", "snapshot_key", "stage_metadata", "store_metadata"]

HASH_SCHEME = "sha256-json-v2"  # row_hash: sha256 of the row's non-null cells as `"name":json`, by column name
METADATA_MEMORY = "256MB"  # DuckDB's cap while it assembles, compares and sorts; past it, it spills to disk. It runs
# inside the ingest flow (~0.7 GB of its own at 1M items), which must stay under 1 GB at 1M (BENCHMARKS.md)
SNAPSHOT_ROW_GROUP = 32_768
SORT_MEMORY = "256MB"  # the snapshot's sort by item_id, one thread (as a state's snapshot sorts)


class NoMetadataError(MetadataError):
    """A text model was asked to ingest a store that holds no catalogue metadata."""


@dataclass
class MetadataReport:
    source: str
    rows: int
    new: int = 0
    changed: int = 0
    removed: int = 0
    unchanged: int = 0
    unknown_items: int = 0  # rows whose item_id the catalogue listing does not have
    unknown_examples: list[str] | None = None
    without_row: int = 0  # listed images without a metadata row
    without_row_examples: list[str] | None = None
    snapshot_seq: int = 0
    written: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


_quoted = sql_name  # a metadata column's name as a DuckDB identifier


def _kind(sql_type: str) -> str:
    t = sql_type.upper()
    if t in ("TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT", "USMALLINT", "UINTEGER", "UBIGINT",
             "FLOAT", "DOUBLE") or t.startswith("DECIMAL"):
        return "number"
    if t == "VARCHAR":
        return "string"
    if t == "BOOLEAN":
        return "boolean"
    if t.endswith("[]"):
        return "list"
    if t.startswith("STRUCT"):
        return "object"
    return t.lower()


def row_hash_sql(columns: list[str]) -> str:
    """A row's hash: sha256 over its non-null cells, each `"name":<value as JSON>`, in column-name order. An
    absent cell and a null are the same, so a column added with no values changes no row."""
    cells = [f"'{json.dumps(name)[1:-1]}' || ':' || to_json({_quoted(name)})" for name in sorted(columns)]
    return "sha256(concat_ws(chr(30), " + ", ".join(cells) + "))" if cells else "sha256('')"


class StagedMetadata:
    """A metadata file read, checked and assembled on local disk: the DuckDB table `staged` (typed columns and
    `row_hash`, one row per item_id). The folder and its database go with the object."""

    def __init__(self, url: str) -> None:
        import duckdb

        self.url = url
        self.folder = scratch_folder(self, "metadata")
        self.db = duckdb.connect(os.path.join(self.folder, "metadata.duckdb"), config={
            "memory_limit": METADATA_MEMORY, "temp_directory": os.path.join(self.folder, "spill"),
            "preserve_insertion_order": False, "allocator_flush_threshold": ALLOCATOR_FLUSH})
        self.rows = 0
        self.columns: list[str] = []
        self.ordered = False  # `staged` holds its rows in item_id order already: the snapshot needs no sort

    def close(self) -> None:
        self.db.close()

    def table(self) -> pa.Table:
        """Every row in memory, sorted by item_id (small files: tests, tools)."""
        return self.db.sql(f"SELECT {self._select()} FROM staged ORDER BY item_id").to_arrow_table()

    def _select(self) -> str:
        return ", ".join(_quoted(c) for c in [*self.columns, "row_hash"])

    def write_parquet(self, path: str, metadata: dict[str, str]) -> None:
        """The rows in item_id order into a Parquet file (zstd): as they are when the file came sorted, else
        through DuckDB's external sort (at 10M rows of product text, most of the stage's time)."""
        kv = ", ".join(f"{sql_string(k)}: {sql_string(v)}" for k, v in metadata.items())
        # row groups of 32,768 rows (~20 MB of product text): what a caption shard reads at least, and what DuckDB's
        # writer holds while it fills one (groups of 122,880 rows of 540-byte rows ran out of the 256 MB cap)
        options = f"(FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE {SNAPSHOT_ROW_GROUP}, KV_METADATA {{{kv}}})"
        if self.ordered:
            with in_order(self.db), one_thread(self.db) as cur:
                cur.execute(f"COPY (SELECT {self._select()} FROM staged) TO {sql_string(path)} {options}")
            return
        with one_thread(self.db, SORT_MEMORY) as cur:
            cur.execute(f"COPY (SELECT {self._select()} FROM staged ORDER BY item_id) TO {sql_string(path)} "
                        f"{options}")


@contextmanager
def in_order(con) -> Iterator:
    """DuckDB keeping rows in the order it reads them, for the statements inside."""
    con.execute("SET preserve_insertion_order = true")
    try:
        yield con
    finally:
        con.execute("SET preserve_insertion_order = false")


class NotInOrder(ValueError):
    """Item ids that do not ascend where a merge on item_id needs them to."""


class _SnapshotNotInOrder(NotInOrder):
    pass


def write_merged(snapshot: str, keys: str, columns: list[str], names: list[str], out: str, batch_rows: int) -> None:
    """Write to `out` (a Parquet file) the rows of `keys` (a Parquet file whose `item_id` column ascends, each id
    once), their `columns`, with the columns `names` of `snapshot` (a snapshot's local file) beside, row for row:
    null where the item has no row; an item twice in a damaged snapshot gets its row with the least row_hash. The
    two are merged a batch of `batch_rows` at a time (`merged_rows`), never joined N by N. A snapshot out of
    item_id order (written before snapshots were sorted) is sorted on disk first, beside `out`; keys out of order
    are the caller's error (NotInOrder)."""
    def write(source: str) -> None:
        reader = parquet_reader(keys)
        batches = (pa.Table.from_batches([b]) for b in reader.iter_batches(batch_rows, columns=columns))
        fields = [reader.schema_arrow.field(n) for n in columns] + \
            [snapshot_fields.field(n).with_nullable(True) for n in names]  # an item may have none
        _write_tables(merged_rows(source, batches, names, batch_rows), pa.schema(fields), out, batch_rows)

    snapshot_fields = parquet_reader(snapshot).schema_arrow
    try:
        write(snapshot)
    except _SnapshotNotInOrder:
        import uuid

        ordered = f"{out}.{uuid.uuid4().hex}.sorted.parquet"
        try:
            with scratch_sql(os.path.dirname(out)) as con, one_thread(con, SORT_MEMORY):
                con.execute(f"""COPY (SELECT * FROM read_parquet({sql_string(snapshot)}) ORDER BY item_id, row_hash)
                                TO {sql_string(ordered)} (FORMAT parquet, ROW_GROUP_SIZE {batch_rows})""")
            write(ordered)
        finally:
            if os.path.exists(ordered):
                os.remove(ordered)
    # the batches' pages back to the system before the caller's sort: the pool kept ~100 MB of them at 1M items
    pa.default_memory_pool().release_unused()


def _write_tables(tables: Iterator[pa.Table], schema: pa.Schema, out: str, row_group: int) -> None:
    # a scratch file, read once: neither compressed nor dictionary-encoded (Parquet's defaults write it slower)
    with pq.ParquetWriter(out, schema, compression="none", use_dictionary=False) as writer:
        for table in tables:
            writer.write_table(table.cast(schema), row_group_size=row_group)


def merged_rows(snapshot: str, keys: Iterator[pa.Table], names: list[str], batch_rows: int) -> Iterator[pa.Table]:
    """Each table of `keys` with the snapshot's columns `names` beside (`write_merged`), the snapshot sorted by
    item_id: what is held is one table of keys and the snapshot rows of its range. NotInOrder when either side's
    ids do not ascend."""
    reader = parquet_reader(snapshot)
    read = ["item_id", "row_hash", *(n for n in names if n != "row_hash")]
    later = _ascending((pa.Table.from_batches([b]) for b in reader.iter_batches(batch_rows, columns=read)),
                       _SnapshotNotInOrder(snapshot), repeats=True)
    window = pa.schema([pa.field("item_id", pa.string()), *(reader.schema_arrow.field(n) for n in read[1:])]) \
        .empty_table()
    done = False
    for table in _ascending(keys, NotInOrder("the keys"), repeats=False):
        ids = table["item_id"]
        if not len(ids):
            yield _beside(table, window.select(names).slice(0, 0))
            continue
        first, last = ids[0], ids[-1].as_py()
        while not done and (not len(window) or window["item_id"][-1].as_py() <= last):
            try:  # the snapshot's rows up to past this table's last id; none before its first can match again
                batch = next(later)
                window = pa.concat_tables([window, batch.filter(pc.greater_equal(batch["item_id"], first))])
            except StopIteration:
                done = True
        window = _least_hash_first(window)
        at = pc.index_in(ids, value_set=window["item_id"].combine_chunks())
        yield _beside(table, window.select(names).take(at))
        window = window.filter(pc.greater(window["item_id"], last))


def _beside(table: pa.Table, columns: pa.Table) -> pa.Table:
    for field in columns.schema:
        table = table.append_column(field, columns[field.name])
    return table


def _ascending(tables: Iterator[pa.Table], error: NotInOrder, repeats: bool) -> Iterator[pa.Table]:
    """`tables` with their item_id column as strings, checked to ascend (with equal neighbours if `repeats`)."""
    step, last = (pc.less if repeats else pc.less_equal), None
    for table in tables:
        ids = table["item_id"].cast(pa.string()).combine_chunks()
        if ids.null_count or (last is not None and len(ids) and step(ids[0], pa.scalar(last)).as_py()) or \
                pc.any(step(ids[1:], ids[:-1])).as_py():
            raise type(error)(f"{error}: item ids out of order")
        last = ids[-1].as_py() if len(ids) else last
        yield table.set_column(table.column_names.index("item_id"), "item_id", ids)


def _least_hash_first(window: pa.Table) -> pa.Table:
    """The window (sorted by item_id) with one row per item: its least row_hash where an item repeats."""
    ids = window["item_id"].combine_chunks()
    if len(ids) < 2 or not pc.any(pc.equal(ids.slice(1), ids.slice(0, len(ids) - 1))).as_py():
        return window
    window = window.sort_by([("item_id", "ascending"), ("row_hash", "ascending")])
    ids = window["item_id"].combine_chunks()
    repeat = pc.equal(ids.slice(1), ids.slice(0, len(ids) - 1))
    return window.filter(pa.concat_arrays([pa.array([True]), pc.invert(repeat)]))


def stage_metadata(url: str) -> StagedMetadata:
    """Read and check the file: item_id present, non-empty and unique; CSV columns typed over the whole column
    (all integers, else all numbers, else text; ids and text columns stay text); a row_hash of each row's
    content. Raises MetadataError naming the line of the first problem."""
    staged = StagedMetadata(url)
    try:
        parts = read_parts(url, staged.folder)
        _assemble(staged, parts)
    except BaseException:
        staged.close()
        raise
    return staged


def _assemble(staged: StagedMetadata, parts: Parts) -> None:
    con = staged.db
    files = "[" + ", ".join(sql_string(p) for p in parts.paths) + "]"
    if not parts.paths:  # a header and no rows
        con.execute("CREATE TABLE staged (item_id VARCHAR, product_id VARCHAR, title VARCHAR, caption VARCHAR, "
                    "description VARCHAR, row_hash VARCHAR)")
        staged.columns = ["item_id", "product_id", *TEXT_COLUMNS]
        return
    try:
        con.execute(f"CREATE VIEW raw AS SELECT * FROM read_parquet({files}, union_by_name = true)")
    except Exception as exc:  # noqa: BLE001 - DuckDB could not unify the parts' columns
        raise MetadataError(f"{redact(parts.url)}: a column holds values of different types ({exc})") from exc
    described = con.execute("SELECT column_name, column_type FROM (DESCRIBE raw)").fetchall()
    types = {name: kind for name, kind in described if name not in ("_row", "_line")}
    if parts.fmt == "jsonl":
        _check_one_kind(con, parts, files)
    if not parts.ordered:  # strictly increasing ids are unique already
        _check_unique(con, parts)
    text = {*ID_COLUMNS, *TEXT_COLUMNS}
    typed = _csv_types(con, [c for c in types if c not in text]) if parts.fmt == "csv" else {}
    columns = ["item_id", "product_id", *TEXT_COLUMNS]
    columns += sorted(set(types) - set(columns))
    select = []
    for name in columns:
        if name not in types:
            select.append(f"CAST(NULL AS VARCHAR) AS {_quoted(name)}")
        elif name in text:
            select.append(f"CAST({_quoted(name)} AS VARCHAR) AS {_quoted(name)}")
        elif name in typed:
            select.append(f"CAST({_quoted(name)} AS {typed[name]}) AS {_quoted(name)}")
        else:
            select.append(_quoted(name))
    present = [c for c in columns if c in types]
    with in_order(con) if parts.ordered else nullcontext():
        con.execute(f"CREATE TABLE staged AS SELECT *, {row_hash_sql(present)} AS row_hash "
                    f"FROM (SELECT {', '.join(select)} FROM raw)")
    staged.columns, staged.rows, staged.ordered = columns, parts.rows, parts.ordered


def _check_unique(con, parts: Parts) -> None:
    """One row per item_id: the first item seen twice, by where its second row is."""
    found = con.execute("""
        WITH ids AS (SELECT CAST(item_id AS VARCHAR) AS item_id, _row FROM raw),
             twice AS (SELECT item_id, min(_row) AS first FROM ids GROUP BY item_id HAVING count(*) > 1)
        SELECT ids.item_id, twice.first, min(ids._row) AS second FROM ids JOIN twice USING (item_id)
        WHERE ids._row > twice.first GROUP BY ids.item_id, twice.first ORDER BY second LIMIT 1""").fetchone()
    if found:
        item, first, second = found
        lines = _lines(con, parts, [first, second])
        there, here = parts.where([first, second], lines)
        raise MetadataError(f"{redact(parts.url)} {here}: item_id {item!r} again (first at {there}); one row per "
                            "item")


def _lines(con, parts: Parts, rows: list[int]) -> list[int] | None:
    if parts.fmt != "jsonl":
        return None
    found = dict(con.execute(f"SELECT _row, _line FROM raw WHERE _row IN ({', '.join(map(str, rows))})").fetchall())
    return [found[r] for r in rows]


def _check_one_kind(con, parts: Parts, files: str) -> None:
    """A JSONL column holds one kind of value (numbers, strings, lists, ...) across the blocks Arrow typed one
    by one; the first line where another kind appears is named."""
    seen: dict[str, tuple[str, str]] = {}
    for path in parts.paths:
        for name, sql_type in con.execute(
                f"SELECT column_name, column_type FROM (DESCRIBE SELECT * FROM read_parquet({sql_string(path)}))"
        ).fetchall():
            if name in ("_row", "_line") or sql_type == '"NULL"' or sql_type.upper() == "NULL":
                continue
            kind = _kind(sql_type)
            if name not in seen:
                seen[name] = (kind, path)
            elif seen[name][0] != kind:
                line = con.execute(f"SELECT min(_line) FROM read_parquet({sql_string(path)}) "
                                   f"WHERE {_quoted(name)} IS NOT NULL").fetchone()[0]
                raise MetadataError(f"{redact(parts.url)} line {line}: column {name!r} holds a {kind} here and a "
                                    f"{seen[name][0]} before; one type a column")


def _csv_types(con, names: list[str]) -> dict[str, str]:
    """A CSV column whose every non-empty cell is an integer becomes BIGINT, else one whose every cell is a
    number DOUBLE (so `price < 50` compares numbers); anything else stays text."""
    if not names:
        return {}
    checks = []
    for name in names:
        q = _quoted(name)
        checks += [f"count({q})",
                   f"count(*) FILTER (WHERE regexp_full_match(trim({q}), '[+-]?[0-9]+') "
                   f"AND TRY_CAST({q} AS BIGINT) IS NOT NULL)",
                   f"count(TRY_CAST({q} AS DOUBLE))"]
    counts = con.execute(f"SELECT {', '.join(checks)} FROM raw").fetchone()
    types = {}
    for n, name in enumerate(names):
        cells, integers, numbers = counts[3 * n:3 * n + 3]
        if cells and integers == cells:
            types[name] = "BIGINT"
        elif cells and numbers == cells:
            types[name] = "DOUBLE"
    return types


def read_metadata(url: str) -> pa.Table:
    """The metadata table, checked and hashed, in memory, sorted by item_id: for small files (tests, tools);
    ingest streams it (`store_metadata`)."""
    staged = stage_metadata(url)
    try:
        return staged.table()
    finally:
        staged.close()


def latest_seq(store: Location) -> int:
    names = [n for n in store.list_names(SNAPSHOTS) if n.endswith(".parquet") and n[:-8].isdigit()]
    return max((int(n[:-8]) for n in names), default=0)


def snapshot_file(store: Location, cache_dir: str) -> str | None:
    """A local Parquet file of the latest snapshot (the file itself in a local store, else a copy under
    `cache_dir`, downloaded once per snapshot), or None when the store has none: for DuckDB to join on disk."""
    seq = latest_seq(store)
    if not seq:
        return None
    return local_copy(store, snapshot_key(seq), cache_dir, checksum=str(seq), suffix=".parquet")


def load_metadata(store: Location) -> pa.Table | None:
    """The latest stored metadata snapshot as one table in memory, or None when the store has none: for tests
    and small stores; the service, export and sync read it on disk (`snapshot_file`)."""
    seq = latest_seq(store)
    return store.read_table(snapshot_key(seq)) if seq else None


def _listed_view(con, listing) -> bool:
    """The view `listed(key)` over a Listing (its table or its spill files); False without one."""
    if listing is None:
        return False
    source = listing.source
    if isinstance(source, pa.Table):
        con.register("listing_table", source.select(["key"]))
        con.execute("CREATE OR REPLACE TEMP VIEW listed AS SELECT key FROM listing_table")
    elif source:
        files = "[" + ", ".join(sql_string(p) for p in source) + "]"
        con.execute(f"CREATE OR REPLACE TEMP VIEW listed AS SELECT key FROM read_parquet({files})")
    else:
        con.execute("CREATE OR REPLACE TEMP VIEW listed AS SELECT CAST(NULL AS VARCHAR) AS key WHERE false")
    return True


def _previous_view(con, store: Location, seq: int, folder: str) -> None:
    """The view `previous(item_id, row_hash)` of the last snapshot; one written before the current hash scheme
    is hashed again from its cells, so an upgrade alone changes no row."""
    if not seq:
        con.execute("CREATE OR REPLACE TEMP VIEW previous AS SELECT CAST(NULL AS VARCHAR) AS item_id, "
                    "CAST(NULL AS VARCHAR) AS row_hash WHERE false")
        return
    key = snapshot_key(seq)
    path = local_copy(store, key, os.path.join(folder, "previous"), checksum=str(seq), suffix=".parquet")
    scheme = store.read_parquet_metadata(key).get("imgest.row_hash") if not store.is_local else None
    if store.is_local:
        import pyarrow.parquet as pq

        scheme = ((pq.read_metadata(path).metadata or {}).get(b"imgest.row_hash") or b"").decode() or None
    source = f"read_parquet({sql_string(path)})"
    if scheme == HASH_SCHEME:
        con.execute(f"CREATE OR REPLACE TEMP VIEW previous AS SELECT item_id, row_hash FROM {source}")
        return
    names = [n for (n,) in con.execute(f"SELECT column_name FROM (DESCRIBE SELECT * FROM {source})").fetchall()
             if n != "row_hash"]
    con.execute(f"CREATE OR REPLACE TEMP VIEW previous AS SELECT item_id, {row_hash_sql(names)} AS row_hash "
                f"FROM {source}")


def store_metadata(store: Location, url: str, listing=None, staged: StagedMetadata | None = None) -> MetadataReport:
    """Read the file at `url` (or take it `staged`), compare it with the last snapshot, and write the next one
    only if a row is new, changed or gone; count rows and listed images that do not meet (`listing`: the run's
    Listing, or None). Call with the store lock held (the ingest's)."""
    own = staged is None
    staged = stage_metadata(url) if own else staged
    try:
        return _store(store, url, listing, staged)
    finally:
        if own:
            staged.close()


def _store(store: Location, url: str, listing, staged: StagedMetadata) -> MetadataReport:
    con = staged.db
    report = MetadataReport(source=redact(url), rows=staged.rows)
    if _listed_view(con, listing):  # one join for both counts; the examples only where there are some
        report.unknown_items, report.without_row = con.execute("""
            SELECT count(*) FILTER (WHERE listed.key IS NULL), count(*) FILTER (WHERE s.item_id IS NULL)
            FROM (SELECT item_id FROM staged) s FULL OUTER JOIN listed ON s.item_id = listed.key""").fetchone()
        report.unknown_examples = [r for (r,) in con.execute(
            "SELECT item_id FROM staged ANTI JOIN listed ON staged.item_id = listed.key ORDER BY item_id LIMIT 10"
        ).fetchall()] if report.unknown_items else []
        report.without_row_examples = [r for (r,) in con.execute(
            "SELECT key FROM listed ANTI JOIN staged ON staged.item_id = listed.key ORDER BY key LIMIT 10"
        ).fetchall()] if report.without_row else []
    seq = latest_seq(store)
    _previous_view(con, store, seq, staged.folder)
    report.new, report.changed, report.unchanged, report.removed = con.execute("""
        SELECT count(*) FILTER (WHERE p.item_id IS NULL),
               count(*) FILTER (WHERE s.item_id IS NOT NULL AND p.item_id IS NOT NULL AND p.row_hash <> s.row_hash),
               count(*) FILTER (WHERE s.item_id IS NOT NULL AND p.item_id IS NOT NULL AND p.row_hash = s.row_hash),
               count(*) FILTER (WHERE s.item_id IS NULL)
        FROM (SELECT item_id, row_hash FROM staged) s FULL OUTER JOIN previous p ON s.item_id = p.item_id""").fetchone()
    report.snapshot_seq = seq
    if report.new or report.changed or report.removed or not seq:
        report.snapshot_seq, report.written = seq + 1, True
        meta = {"imgest.source": report.source, "imgest.created": now_iso(), "imgest.rows": str(staged.rows),
                "imgest.row_hash": HASH_SCHEME, "imgest.report": json.dumps(report.to_dict(), sort_keys=True)}
        path = os.path.join(staged.folder, "snapshot.parquet")
        staged.write_parquet(path, meta)
        store.put_file(snapshot_key(seq + 1), path)
        os.remove(path)
    return report
