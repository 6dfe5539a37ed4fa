"""Compare a listing with the committed state: new, changed, unchanged, deleted; cut work into shards."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from imgest.errors import UserError
from imgest.images.listing import Listing, printable_key
from imgest.names import DEFAULT_MAX_BYTES, DEFAULT_SHARD_SIZE
from imgest.state.committed import DELETED, FAILED, LIVE, CatalogueState, ItemState, revivable
from imgest.state.rows import ALLOCATOR_FLUSH, STATE_MEMORY
from imgest.storage import Location, parquet_reader


@dataclass(frozen=True)
class WorkItem:
    item_id: str
    uri: str
    size: int
    mtime: float | None
    etag: str | None
    prev_hash: str | None  # content hash on record; equal bytes mean "touched, not changed"
    base_shard: str | None = None  # a head model: the base model's current embedding of these bytes is there
    base_hash: str | None = None  # ... for content with this hash
    verdict: str | None = None  # rejected from its listing alone (key, size, storage class): never read
    revive_shard: str | None = None  # a recent tombstone's row: revived if the bytes still hash to prev_hash
    kept_shard: str | None = None  # a kept copy of these bytes is in this shard's pixel file (imgest/state/pixels.py)
    kept_hash: str | None = None  # ... for content with this hash
    kept_side: int | None = None  # ... at this side


@dataclass(frozen=True)
class ShardPlan:
    run_id: str
    index: int
    items: tuple[WorkItem, ...]

    @property
    def name(self) -> str:
        return f"part-{self.run_id}-{self.index:05d}"


WORK_SCHEMA = pa.schema([("item_id", pa.string()), ("uri", pa.string()), ("size", pa.int64()),
                         ("mtime", pa.float64()), ("etag", pa.string()), ("prev_hash", pa.string()),
                         ("base_shard", pa.string()), ("base_hash", pa.string()), ("verdict", pa.string()),
                         ("revive_shard", pa.string()), ("kept_shard", pa.string()), ("kept_hash", pa.string()),
                         ("kept_side", pa.int32())])  # WorkItem's fields, in order


class PlannedShards(Sequence):
    """The shards a run will read, as a Parquet file on local disk holding their objects (WORK_SCHEMA) in key
    order, one row group a shard: a cold start plans every catalogue object, and the run holds one shard's
    WorkItems at a time, not the catalogue's. The file goes with the object."""

    def __init__(self, run_id: str) -> None:
        from imgest.scratch import scratch_folder

        self.run_id = run_id
        self.path = os.path.join(scratch_folder(self, "plan"), "work.parquet")
        self._writer: pq.ParquetWriter | None = pq.ParquetWriter(self.path, WORK_SCHEMA)
        self._sizes: list[int] = []

    def write(self, items: list[WorkItem]) -> None:
        """Append one shard's objects (called in shard order, then `close`)."""
        columns = {name: [getattr(item, name) for item in items] for name in WORK_SCHEMA.names}
        self.write_table(pa.table(columns, schema=WORK_SCHEMA))

    def write_table(self, table: pa.Table) -> None:
        """Append one shard's objects as rows of WORK_SCHEMA."""
        self._writer.write_table(table, row_group_size=max(len(table), 1))
        self._sizes.append(len(table))

    def close(self) -> PlannedShards:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self.counts = np.asarray(self._sizes, np.int64)
        self.rows = int(self.counts.sum())
        return self

    def __len__(self) -> int:
        return len(self.counts)

    def __getitem__(self, at):
        if isinstance(at, slice):
            return [self[i] for i in range(*at.indices(len(self)))]
        if not -len(self) <= at < len(self):
            raise IndexError(at)
        at %= len(self)
        rows = parquet_reader(self.path).read_row_group(at).to_pylist()
        return ShardPlan(self.run_id, at, tuple(WorkItem(**row) for row in rows))

    def __iter__(self) -> Iterator[ShardPlan]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None


@dataclass
class Plan:
    run_id: str
    listed: int
    skipped: int
    not_regular: int = 0
    new: int = 0
    changed_candidates: int = 0  # signature differs; bytes will tell whether content did
    unchanged: int = 0
    retried: int = 0  # failed last time for a transient reason: read again whatever their signature
    deleted: list[str] = field(default_factory=list)
    shards: Sequence[ShardPlan] = field(default_factory=list)

    @property
    def to_read(self) -> int:
        if isinstance(self.shards, PlannedShards):
            return self.shards.rows
        return sum(len(s.items) for s in self.shards)

    def any_to_decode(self) -> bool:
        """Whether any planned object is to be read and decoded, not derived from a base model's vector."""
        if isinstance(self.shards, PlannedShards):
            column = pq.read_table(self.shards.path, columns=["base_shard"])["base_shard"]
            return column.null_count > 0
        return any(not item.base_shard for shard in self.shards for item in shard.items)

    def kept_count(self) -> int:
        """Planned objects to be read from a kept copy (attach_kept): from the plan file's footer, no column read."""
        if isinstance(self.shards, PlannedShards):
            meta = pq.ParquetFile(self.shards.path).metadata
            at = WORK_SCHEMA.get_field_index("kept_shard")
            return sum(meta.row_group(g).num_rows - meta.row_group(g).column(at).statistics.null_count
                       for g in range(meta.num_row_groups))
        return sum(item.kept_shard is not None for shard in self.shards for item in shard.items)

    def counts(self) -> np.ndarray:
        """Objects in each shard, in order."""
        if isinstance(self.shards, PlannedShards):
            return self.shards.counts
        return np.asarray([len(s.items) for s in self.shards], np.int64)

    def decode_sample(self, n: int = 16) -> tuple[WorkItem, ...]:
        """Up to `n` objects of the first shard that will be read and decoded (not derived, not refused from
        their listing): where the run measures what a decode costs."""
        items = self.shards[0].items if self.shards else ()
        return tuple(i for i in items if i.verdict is None and not i.base_shard)[:n]


# the same object as the state's row: ETag and size when both sides have an ETag (object stores), otherwise size
# and mtime (file systems); in SQL over the listing (l) joined with the state (s)
SAME_SIGNATURE_SQL = """CASE WHEN coalesce(l.etag, '') <> '' AND coalesce(s.etag, '') <> ''
                             THEN l.etag = s.etag AND l.size = s.size
                             ELSE l.size = s.size AND l.mtime IS NOT NULL AND s.mtime IS NOT NULL
                                  AND abs(l.mtime - s.mtime) < 1e-6 END"""


class MassDeleteError(UserError, ValueError):
    """A run would tombstone more of the live items than allowed; nothing was changed."""


ARCHIVED = frozenset({"GLACIER", "DEEP_ARCHIVE"})  # unreadable until restored (GLACIER_IR reads at once)
item_key = printable_key  # the item id of a listed key


def listing_verdict(key: str, key_ok: bool, size: int, storage_class: str | None, max_bytes: int) -> str | None:
    """Why a listed object is rejected from its listing alone, without reading it; None when it is to be read."""
    if not key_ok:
        return f"KeyError: the key is not valid UTF-8 ({key!r}); rename the object"
    if storage_class and storage_class.upper() in ARCHIVED:
        return f"ArchivedObject: storage class {storage_class} cannot be read until it is restored"
    if size > max_bytes:
        return f"TooLarge: {size} bytes, over max_bytes {max_bytes}"
    return None


def check_deletions(live: int, gone: int, listed: int, max_fraction: float) -> None:
    """Stop before anything is written when a run would tombstone more than `max_fraction` of the `live` items
    (`gone` of them unlisted), or see an empty listing over a non-empty state: a wrong prefix or a half-synced
    bucket."""
    if live and (gone > max_fraction * live or listed == 0):
        raise MassDeleteError(
            f"this run would tombstone {gone} of {live} live items ({gone / live:.0%}, over the allowed "
            f"{max_fraction:.0%}){' from an empty listing' if listed == 0 else ''}: a wrong prefix or a "
            "half-synced bucket? Nothing was changed. If the deletions are real, run again with --allow-mass-delete")


PLAN_MEMORY = STATE_MEMORY  # DuckDB's memory for the plan's join; a larger catalogue spills to disk
# DuckDB's hash join cannot spill all of a join this large: at 100M rows a side it needs ~3 GB and fails under
# 1 GB (BENCHMARKS.md). A larger catalogue is planned in passes, one per hash partition of the item ids, each
# joining at most about this many rows a side (8M fit in 1 GB, measured).
PLAN_PARTITION_ROWS = 4_000_000


def _relation(con, name: str, source: pa.Table | str | list[str]) -> None:
    """A table of the plan's query: an Arrow table, or Parquet files DuckDB streams from disk."""
    if isinstance(source, (str, list)):
        con.read_parquet(source).create_view(name)
    else:
        con.register(name, source)


@contextmanager
def _plan_connection(state: CatalogueState | pa.Table | str, files: bool) -> Iterator:
    """A DuckDB connection where `state` is the catalogue state: the CatalogueState's own database (its rows
    stay on disk), or a bounded one over an Arrow table or a Parquet file."""
    if isinstance(state, CatalogueState):
        with state.sql() as con:
            yield con
        return
    import duckdb

    # past PLAN_MEMORY DuckDB spills to a temporary folder instead of growing
    config = {"enable_external_access": files, "memory_limit": PLAN_MEMORY,
              "preserve_insertion_order": False, "temp_directory": os.path.join(tempfile.gettempdir(), "imgest-plan"),
              "allocator_flush_threshold": ALLOCATOR_FLUSH}
    with duckdb.connect(config=config) as con:
        _relation(con, "state", state)
        yield con


STATE_COLUMNS = "item_id, status, etag, size, mtime, content_hash, shard, updated_at"  # what the plan reads of it


def _partition(con, name: str, key: str, parts: int, folder: str, columns: str = "*") -> None:
    """`name` written under `folder` as Parquet files by hash partition of `key`, in one pass. Small row groups:
    the writer holds one open group per partition and thread, and they must fit DuckDB's memory cap beside it."""
    target = os.path.join(folder, name).replace("'", "''")
    con.execute(f"""COPY (SELECT {columns}, hash({key}) % {parts} AS part FROM {name}) TO '{target}'
                    (FORMAT parquet, PARTITION_BY (part), ROW_GROUP_SIZE 16384)""")


def _part(folder: str, name: str, part: int) -> str:
    """A relation of one hash partition written by `_partition` (none of `name`'s rows fell in an empty one)."""
    path = os.path.join(folder, name, f"part={part}")
    if not os.path.isdir(path):
        return f"(SELECT * FROM {name} LIMIT 0)"
    return f"read_parquet('{os.path.join(path, '*.parquet').replace(chr(39), chr(39) * 2)}')"


def plan_ingest(listing: Listing, state: CatalogueState | pa.Table | str, run_id: str,
                shard_size: int = DEFAULT_SHARD_SIZE, max_bytes: int = DEFAULT_MAX_BYTES,
                max_delete_fraction: float | None = None, listing_source: pa.Table | str | None = None,
                now: datetime | None = None) -> Plan:
    """Decide what to read. Unchanged objects (same signature) are never read.

    Rejected items are retried only when they change, failed ones (a transient reason) on every run;
    deleted ones come back as new, revived from their tombstone's row when the bytes are the same.
    `max_delete_fraction` (None: no limit) stops a run that would delete too much (MassDeleteError).

    A columnar join (DuckDB) of the listing with the state (STATE_SCHEMA: a CatalogueState, an Arrow table or
    a Parquet file); only the objects to read and the items to delete come back as Python objects, so memory
    follows the change, not the catalogue. `listing_source` replaces `listing.source` (a Parquet file of it).
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    plan = Plan(run_id=run_id, listed=0, skipped=listing.skipped, not_regular=listing.not_regular)
    catalogue = Location(listing.catalogue, follow_links=True)
    listed = listing.source if listing_source is None else listing_source
    files = isinstance(state, (str, CatalogueState)) or isinstance(listed, (str, list))
    with _plan_connection(state, files) as con, tempfile.TemporaryDirectory(prefix="imgest-plan-") as folder:
        _relation(con, "listing", listed)
        plan.listed = con.execute("SELECT count(*) FROM listing").fetchone()[0]
        items, live = con.execute(f"SELECT count(*), count(*) FILTER (status = '{LIVE}') FROM state").fetchone()
        parts = max(1, -(-max(plan.listed, items) // PLAN_PARTITION_ROWS))
        if parts > 1 and files:  # each input written in its hash partitions once: a pass reads only its own
            _partition(con, "listing", "key", parts, folder)
            _partition(con, "state", "item_id", parts, folder, STATE_COLUMNS)
        gone = 0
        sources = []
        for part in range(parts):
            listing_part, state_part = ("listing", "state") if parts == 1 else \
                (_part(folder, "listing", part), _part(folder, "state", part)) if files else (
                f"(SELECT * FROM listing WHERE hash(key) % {parts} = {part})",
                f"(SELECT * FROM state WHERE hash(item_id) % {parts} = {part})")
            sources.append((listing_part, state_part))
            work = f"""SELECT l.key, l.key_ok, l.size, l.mtime, l.etag, l.storage_class,
                              s.status, s.content_hash, s.shard, s.updated_at
                       FROM {listing_part} l LEFT JOIN {state_part} s ON s.item_id = l.key
                       WHERE s.item_id IS NULL OR s.status IN ('{DELETED}', '{FAILED}') OR NOT ({SAME_SIGNATURE_SQL})"""
            if files:  # the work of a cold start is every object: it goes to a file, not into memory
                con.execute(f"COPY ({work}) TO '{_quoted(os.path.join(folder, f'work-{part}.parquet'))}' "
                            "(FORMAT parquet)")
            else:
                con.execute(f"CREATE OR REPLACE TEMP TABLE work_{part} AS {work}")
            gone += con.execute(f"""
                SELECT count(*) FROM {state_part} s ANTI JOIN {listing_part} l
                ON s.item_id = l.key WHERE s.status = '{LIVE}'""").fetchone()[0]
        if max_delete_fraction is not None:  # counted, not collected: an empty listing at 100M is refused as cheaply
            check_deletions(live, gone, plan.listed, max_delete_fraction)
        plan.deleted = sorted(item_id for listing_part, state_part in sources for (item_id,) in con.execute(f"""
            SELECT s.item_id FROM {state_part} s ANTI JOIN {listing_part} l
            ON s.item_id = l.key WHERE s.status <> '{DELETED}'""").fetchall())
        every = f"read_parquet('{_quoted(os.path.join(folder, 'work-*.parquet'))}')" if files else \
            "(" + " UNION ALL ".join(f"SELECT * FROM work_{part}" for part in range(parts)) + ")"
        batches = con.sql(f"SELECT * FROM {every} ORDER BY key").to_arrow_reader(WORK_BATCH)
        plan.shards = _write_shards(plan, batches, catalogue, shard_size, max_bytes, now)
    plan.unchanged = plan.listed - plan.to_read
    return plan


WORK_BATCH = 8_192  # planned objects turned into WorkItems at a time (their Python values are transient)


def _quoted(path: str) -> str:
    return path.replace("'", "''")


def _write_shards(plan: Plan, batches, catalogue: Location, shard_size: int, max_bytes: int,
                  now: datetime | None) -> PlannedShards:
    """The planned objects (key order) as WorkItems, shard by shard into a PlannedShards file; the counts of
    new, retried and changed candidates on `plan`."""
    shards, items = PlannedShards(plan.run_id), []
    for batch in batches:
        for key, key_ok, size, mtime, etag, storage_class, status, content_hash, shard, updated_at in zip(
                *(column.to_pylist() for column in batch.columns)):
            prev_hash = revive = None
            if status is None or status == DELETED:
                plan.new += 1
                prev = ItemState(key, "", DELETED, None, 0, None, content_hash, shard, updated_at=updated_at)
                if status == DELETED and revivable(prev, now):
                    prev_hash, revive = content_hash, shard
            elif status == FAILED:
                plan.retried += 1
            else:
                plan.changed_candidates += 1
                prev_hash = content_hash
            items.append(WorkItem(key, catalogue.uri(key), size, mtime, etag, prev_hash,
                                  verdict=listing_verdict(key, key_ok, size, storage_class, max_bytes),
                                  revive_shard=revive))
            if len(items) == shard_size:
                shards.write(items)
                items = []
    if items:
        shards.write(items)
    return shards.close()


def attach_base(plan: Plan, base: CatalogueState) -> Plan:
    """For a head model: every planned item whose base-model embedding is current (live, same signature)
    is marked to be derived from it (the head applied to the stored vector) instead of read and decoded."""
    return _attach(plan, base, {"base_shard": "shard", "base_hash": "content_hash"})


def attach_kept(plan: Plan, source: CatalogueState, shards: pa.Table, min_side: int) -> Plan:
    """Every planned item whose row in `source` (the model whose kept copies are read) is current (live, same
    signature) and whose shard has a pixel file at a side of at least `min_side` (`shards`: shard, side) is marked
    to be read from that copy instead of the catalogue."""
    usable = shards.filter(pc.greater_equal(shards["side"], min_side))
    return _attach(plan, source, {"kept_shard": "shard", "kept_hash": "content_hash", "kept_side": "side"},
                   usable)


def _attach(plan: Plan, other: CatalogueState, fields: dict[str, str], shards: pa.Table | None = None) -> Plan:
    """Fill `fields` (planned column -> column of `other`'s rows) of every planned item whose row in `other` is
    current (live, same signature) and, with `shards`, in one of its shards (columns shard and side).
    The plan's file is matched a group of shards at a time, as Arrow rows, in the other state's DuckDB against
    the state's rows in the group's key range (the plan is in key order and the snapshot's row groups are too,
    so each group reads its own part of it), and the shards are written again as they come: memory follows the
    group, time the catalogue. (One join of the whole plan sorted back into plan order ran out of a 512 MB cap
    at 10M; a column of every item's match is ~110 bytes an item.)"""
    planned = plan.shards if isinstance(plan.shards, PlannedShards) else _to_file(plan.run_id, plan.shards)
    source, attached = parquet_reader(planned.path), PlannedShards(plan.run_id)
    with other.sql() as cur:
        if shards is not None:
            cur.register("kept_shards", shards)
        within = ("(SELECT st.*, k.side FROM state st JOIN kept_shards k ON k.shard = st.shard "
                  "WHERE st.item_id BETWEEN $lo AND $hi)") if shards is not None else \
            "(SELECT * FROM state WHERE item_id BETWEEN $lo AND $hi)"
        columns = ", ".join(f"s.{name}" for name in dict.fromkeys(fields.values()))
        for first, last in _groups(planned.counts, MATCH_ROWS):
            table = source.read_row_groups(range(first, last))
            keys = table["item_id"]
            cur.register("planned", table.append_column("position", pa.array(np.arange(len(table)))))
            found = cur.sql(f"""SELECT {columns} FROM planned l LEFT JOIN {within} s
                                ON s.item_id = l.item_id AND s.status = '{LIVE}' AND s.shard IS NOT NULL
                                    AND ({SAME_SIGNATURE_SQL})
                                ORDER BY l.position""",
                            params={"lo": pc.min(keys).as_py(), "hi": pc.max(keys).as_py()}).to_arrow_table()
            cur.unregister("planned")
            held = pc.is_valid(found["shard"])
            for name, value in fields.items():
                at = WORK_SCHEMA.get_field_index(name)
                table = table.set_column(at, name, pc.if_else(held, found[value].cast(WORK_SCHEMA.field(at).type),
                                                              table[name]))
            at = 0
            for count in planned.counts[first:last]:
                attached.write_table(table.slice(at, count))
                at += count
        if shards is not None:
            cur.unregister("kept_shards")
    plan.shards = attached.close()
    return plan


MATCH_ROWS = 100_000  # planned items matched against the base state at a time (10M in ~15 s, ~250 MB over the flow)


def _groups(counts: np.ndarray, rows: int) -> Iterator[tuple[int, int]]:
    """Consecutive shards [first, last) in groups of at least `rows` items (the last may hold fewer)."""
    first, held = 0, 0
    for at, count in enumerate(counts.tolist()):
        held += count
        if held >= rows:
            yield first, at + 1
            first, held = at + 1, 0
    if first < len(counts):
        yield first, len(counts)


def _to_file(run_id: str, shards: Sequence[ShardPlan]) -> PlannedShards:
    planned = PlannedShards(run_id)
    for shard in shards:
        planned.write(list(shard.items))
    return planned.close()
