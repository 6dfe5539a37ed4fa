"""The committed rows of one model's catalogue state, in a DuckDB database on local disk: its memory is capped
and the rows spill, so planning and folding a 100M-item state never holds it in the flow's memory."""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow as pa
import pyarrow.parquet as pq

from imgest.scratch import scratch_folder

STATE_SCHEMA = pa.schema([
    ("item_id", pa.string()),
    ("uri", pa.string()),
    ("status", pa.string()),
    ("etag", pa.string()),
    ("size", pa.int64()),
    ("mtime", pa.float64()),
    ("content_hash", pa.string()),
    ("shard", pa.string()),
    ("run_id", pa.string()),
    ("reason", pa.string()),
    ("updated_at", pa.string()),
])
STATE_MEMORY = "512MB"  # DuckDB's working memory for one state; past it, joins and sorts spill to its folder. With
# the flow's own ~0.8 GB (Python, torch, Prefect) it keeps every stage of a 10M-item nightly under 2 GB (BENCHMARKS.md,
# "The whole nightly at 1M and 10M"). 256 MB cut a cold start's commit at 1M by ~0.3 GB, but a resumed cold start
# at 10M (10M folded rows planned against the listing) ran out of it: not yet a safe default.
SORT_MEMORY = "256MB"  # a snapshot's sort of every row (one thread): 10M folded rows sorted in 588 MB peak RSS,
# where the state's 512 MB cap took a 1M cold start's commit to 1.27 GB
ALLOCATOR_FLUSH = "16MB"  # DuckDB hands its allocator's freed memory back after a task that peaked past this (its
# default, 128 MB, left a state's join's memory with the process for the stages after it: 50 MB at 1M labels)
SQL_TYPES = {pa.string(): "VARCHAR", pa.int64(): "BIGINT", pa.float64(): "DOUBLE"}
COLUMNS = ", ".join(f'CAST("{f.name}" AS {SQL_TYPES[f.type]}) AS "{f.name}"' for f in STATE_SCHEMA)


def sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def sql_name(name: str) -> str:
    """A column name quoted as a DuckDB identifier (a catalogue's metadata names any column)."""
    return '"' + name.replace('"', '""') + '"'


class StateBase:
    """Rows in STATE_SCHEMA, newest per item, as the DuckDB table or view `base`: a snapshot file read in place,
    or a full snapshot and the deltas after it folded once into a table (which DuckDB keeps on disk).

    Queries go through `cursor(overlay)`, which adds the views `state` (the base with the overlay's rows in
    place of theirs) and `kept` (the base rows the overlay does not replace). The folder goes with the object."""

    def __init__(self) -> None:
        import duckdb

        self.folder = scratch_folder(self, "state")
        self._db = duckdb.connect(os.path.join(self.folder, "state.duckdb"), config={
            "memory_limit": STATE_MEMORY, "temp_directory": os.path.join(self.folder, "spill"),
            "preserve_insertion_order": False, "allocator_flush_threshold": ALLOCATOR_FLUSH})
        weakref.finalize(self, self._db.close)  # with the folder, when the state goes
        self.rows = 0
        self.folded = self.folded_rows = 0  # folds, and rows folded (see `fold`)

    @classmethod
    def empty(cls) -> StateBase:
        return cls().load_table(STATE_SCHEMA.empty_table())

    @classmethod
    def from_table(cls, table: pa.Table) -> StateBase:
        return cls().load_table(table)

    def load_table(self, table: pa.Table) -> StateBase:
        self._db.register("source", table.cast(STATE_SCHEMA))
        self._db.execute(f"CREATE TABLE base AS SELECT {COLUMNS} FROM source")
        self._db.unregister("source")
        self.rows = len(table)
        return self

    def load(self, paths: list[str]) -> StateBase:
        """Snapshot files in order (a full one first, then deltas): a later file's row for an item wins.

        The full snapshot is read in place, never copied: only the deltas (a few percent of it) are folded
        into a table, newest row per item, and `base` is the full snapshot's rows they do not replace plus
        theirs. Folding the full snapshot itself (a window over every row) would need memory in proportion to
        the catalogue."""
        if not paths:
            return self.load_table(STATE_SCHEMA.empty_table())
        full = f"read_parquet({sql_string(paths[0])})"
        if len(paths) == 1:
            self._db.execute(f"CREATE VIEW base AS SELECT {COLUMNS} FROM {full}")
        else:
            deltas = "[" + ", ".join(sql_string(p) for p in paths[1:]) + "]"
            order = "CASE filename " + " ".join(f"WHEN {sql_string(p)} THEN {n}" for n, p in enumerate(paths)) + " END"
            self._db.execute(f"""CREATE TABLE changed AS SELECT {COLUMNS} FROM read_parquet({deltas}, filename = true)
                                 QUALIFY row_number() OVER (PARTITION BY item_id ORDER BY {order} DESC) = 1""")
            self._db.execute(f"""CREATE VIEW base AS
                                 SELECT {COLUMNS} FROM {full} f ANTI JOIN changed c ON c.item_id = f.item_id
                                 UNION ALL SELECT * FROM changed""")
        self.rows = self._db.execute("SELECT count(*) FROM base").fetchone()[0]
        return self

    def close(self) -> None:
        """Give DuckDB's memory back now (its buffers stay cached up to STATE_MEMORY while it is open), not when
        the last reference goes: a flow keeps task results alive until it ends."""
        self._db.close()

    def fold(self, rows: pa.Table) -> None:
        """Append rows (STATE_SCHEMA) to the table `folded`, on disk with the base: a run's encoded rows, which a
        cold start makes one per catalogue item. A later row of an item wins over an earlier one."""
        if self.folded == 0:
            self._db.execute(f"CREATE TABLE IF NOT EXISTS folded AS SELECT 0::BIGINT AS seq, {COLUMNS} "
                             "FROM base LIMIT 0")
        self._db.register("incoming", rows.cast(STATE_SCHEMA))
        self._db.execute(f"INSERT INTO folded SELECT {self.folded_rows} + row_number() OVER () AS seq, {COLUMNS} "
                         "FROM incoming")
        self._db.unregister("incoming")
        self.folded += 1
        self.folded_rows += len(rows)

    @contextmanager
    def cursor(self, overlay: pa.Table) -> Iterator:
        """A connection of its own (safe beside other threads) with the views `overlay` (the folded rows, newest
        per item, with `overlay`'s rows in place of theirs), `state` and `kept`."""
        cur = self._db.cursor()
        try:
            cur.register("overlay_rows", overlay.cast(STATE_SCHEMA))
            if self.folded:
                cur.execute(f"""CREATE TEMP VIEW overlay AS SELECT * FROM overlay_rows UNION ALL
                                SELECT {COLUMNS} FROM (SELECT * FROM folded f WHERE NOT EXISTS (
                                    SELECT 1 FROM overlay_rows o WHERE o.item_id = f.item_id)
                                QUALIFY row_number() OVER (PARTITION BY item_id ORDER BY seq DESC) = 1)""")
            else:
                cur.execute("CREATE TEMP VIEW overlay AS SELECT * FROM overlay_rows")
            cur.execute("CREATE TEMP VIEW kept AS SELECT b.* FROM base b ANTI JOIN overlay o ON o.item_id = b.item_id")
            cur.execute("CREATE TEMP VIEW state AS SELECT * FROM kept UNION ALL SELECT * FROM overlay")
            yield cur
        finally:
            cur.close()


def scratch_sql(folder: str):
    """An in-memory DuckDB connection capped as a state is (STATE_MEMORY), spilling to `folder`/spill."""
    import duckdb

    return duckdb.connect(config={"memory_limit": STATE_MEMORY, "preserve_insertion_order": False,
                                  "temp_directory": os.path.join(folder, "spill"),
                                  "allocator_flush_threshold": ALLOCATOR_FLUSH})


@contextmanager
def one_thread(cur, memory: str | None = None) -> Iterator:
    """DuckDB on one thread for the statements inside: an external sort of wide rows keeps one set of buffers,
    not one per thread (at 400,000 rows of four strings under a 128 MB cap, two threads ran out of memory).
    `memory`: a lower cap for them (the database's, for as long as they run)."""
    threads = int(cur.execute("SELECT current_setting('threads')").fetchone()[0])
    limit = cur.execute("SELECT current_setting('memory_limit')").fetchone()[0]
    cur.execute("SET threads = 1")
    if memory is not None:
        cur.execute(f"SET memory_limit = {sql_string(memory)}")
    try:
        yield cur
    finally:
        cur.execute(f"SET threads = {threads}")
        if memory is not None:
            cur.execute(f"SET memory_limit = {sql_string(limit)}")


def write_rows(reader: pa.RecordBatchReader, path: str, metadata: dict[str, str]) -> int:
    """Stream rows into a Parquet file (zstd, as the store writes tables) with the given footer metadata."""
    rows = 0
    schema = STATE_SCHEMA.with_metadata(metadata)
    with pq.ParquetWriter(path, schema, compression="zstd") as writer:
        for batch in reader:
            writer.write_batch(batch.cast(STATE_SCHEMA))
            rows += batch.num_rows
    return rows
