"""Per-model catalogue state: the last snapshot plus shard commits not yet folded into one.

Layout below the store (``<slug>`` names one model id):
  embeddings/model=<slug>/part-<run>-<NNNNN>.parquet   shard data, written before its commit marker
  state/model=<slug>/commits/part-<run>-<NNNNN>.json   shard commit marker, written last
  state/model=<slug>/snapshots/<seq>.parquet           full catalogue state after a run
  state/model=<slug>/snapshots/<seq>.delta.parquet     or only the items a run changed, on top of the last full one
  state/model=<slug>/model.json                        what the encoder is
A shard is visible only once its marker exists; a snapshot folds markers in and is itself one PUT.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pyarrow.parquet as pq

from imgest.state import pixels
from imgest.state.clock import now_iso
from imgest.state.layout import (
    DELTA,
    commit_key,
    commits_prefix,
    embeddings_prefix,
    file_in,
    snapshot_key,
    snapshots_prefix,
    state_prefix,
)
from imgest.state.markers import check_marker, rows_table
from imgest.state.rows import SORT_MEMORY, STATE_SCHEMA, StateBase, one_thread, write_rows
from imgest.storage import TEMP_PREFIX, Location, StorageError
from imgest.storage.cache import local_copy

# live: a current embedding; rejected: this content cannot be used (retried when the object changes);
# failed: a transient fault (timeout, throttling, memory): retried on the next run; deleted: a tombstone,
# which keeps its last shard for TOMBSTONE_DAYS so that an item coming back with the same bytes is revived.
LIVE, REJECTED, FAILED, DELETED = "live", "rejected", "failed", "deleted"
TOMBSTONE_DAYS = 30

@dataclass
class ItemState:
    item_id: str
    uri: str
    status: str
    etag: str | None
    size: int
    mtime: float | None
    content_hash: str | None
    shard: str | None = None
    run_id: str | None = None
    reason: str | None = None
    updated_at: str | None = None


def read_marker(store: Location, slug: str, shard: str) -> dict:
    """A shard's commit marker, checked before it changes the state: it names its own shard, and its rows are
    objects of ItemState's fields with a string item_id (a planted marker stops the run; nothing changes)."""
    key = commit_key(slug, shard)
    return check_marker(store.read_json(key), shard, f"{store.url}: {key}")


COMPACT_SHARE = 0.1  # a full snapshot again once the deltas since the last one would hold this share of its rows
SNAPSHOT_RETAIN_DAYS = 7  # snapshots a newer full one replaces are kept this long (a reader may still be on one)


def new_run_id(seq: int) -> str:
    """Sortable: snapshot sequence first, so a rerun after a crash sorts after the crashed run."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    return f"r{seq:08d}-{stamp}-{secrets.token_hex(3)}"


def run_seq(run_id: str) -> int:
    return int(run_id[1:9])


def shard_run_id(shard: str) -> str:
    # part-<run_id>-<NNNNN>
    return shard[len("part-"):].rsplit("-", 1)[0]


class CatalogueState:
    """One model's catalogue state: a columnar base (the committed snapshot rows, in a DuckDB database on local
    disk: StateBase) and an overlay of the items changed since (pending commit markers, this run's outcome) as
    Python objects. The ingest and index paths query the base in SQL: the flow's memory grows with the change,
    not with the catalogue. `items` materialises every item as an object, for small stores, reports and tests."""

    def __init__(self, slug: str, items: dict[str, ItemState] | None = None, seq: int = 0,
                 pending: list[str] | None = None, base: StateBase | pa.Table | None = None):
        self.slug, self.seq = slug, seq  # seq: the snapshot this state started from
        self.pending: list[str] = list(pending or [])  # commit markers applied on top
        self._base = StateBase.from_table(base) if isinstance(base, pa.Table) else base  # None: empty, made on use
        self.overlay: dict[str, ItemState] = items if items is not None else {}
        self.full_rows = self.delta_rows = 0  # rows of the last full snapshot, and of the deltas read after it

    @property
    def base(self) -> StateBase:
        if self._base is None:
            self._base = StateBase.empty()
        return self._base

    @property
    def changed(self) -> int:
        """Rows changed since the state was loaded (folded rows counted as written: an item twice, twice)."""
        return len(self.overlay) + (self._base.folded_rows if self._base is not None else 0)

    def _has_rows(self) -> bool:
        return self._base is not None and bool(self._base.rows or self._base.folded)

    def overlay_table(self) -> pa.Table:
        rows = [dataclasses.asdict(item) for item in self.overlay.values()]
        return pa.Table.from_pylist(rows, schema=STATE_SCHEMA)

    def close(self) -> None:
        """Done with the committed rows: their database's memory goes now (see StateBase.close)."""
        if self._base is not None:
            self._base.close()

    @contextmanager
    def sql(self) -> Iterator:
        """A DuckDB connection with the views `state` (every item as now), `kept` (committed rows the overlay does
        not replace) and `overlay`, all in STATE_SCHEMA."""
        with self.base.cursor(self.overlay_table()) as cur:
            yield cur

    def query(self, sql: str, params: list | None = None) -> pa.Table:
        with self.sql() as cur:
            return cur.sql(sql, params=params or None).to_arrow_table()

    @property
    def items(self) -> dict[str, ItemState]:
        """Every item as an ItemState (O(N) objects: not for the nightly path at catalogue scale)."""
        if self._has_rows():
            merged = {row["item_id"]: ItemState(**row) for row in self.query("SELECT * FROM state").to_pylist()}
            self._base, self.overlay = None, merged
        return self.overlay

    def rows(self, item_ids: list[str]) -> dict[str, ItemState]:
        """The items among `item_ids` that exist, the overlay first (a batch lookup, one scan of the base)."""
        found = {i: self.overlay[i] for i in item_ids if i in self.overlay}
        rest = [i for i in item_ids if i not in found]
        if rest and self._has_rows():
            with self.base.cursor(STATE_SCHEMA.empty_table()) as cur:  # `rest` is outside `overlay`: no view of it
                cur.register("wanted", pa.table({"item_id": pa.array(rest, pa.string())}))
                hit = cur.sql("SELECT k.* FROM state k SEMI JOIN wanted w ON w.item_id = k.item_id").to_arrow_table()
            found.update((row["item_id"], ItemState(**row)) for row in hit.to_pylist())
        return found

    def count(self, status: str) -> int:
        if not self._has_rows():
            return sum(1 for item in self.overlay.values() if item.status == status)
        with self.sql() as cur:
            return cur.execute("SELECT count(*) FROM state WHERE status = ?", [status]).fetchone()[0]

    def live(self) -> list[ItemState]:
        return [item for item in self.items.values() if item.status == LIVE]

    def apply_commit(self, marker: dict) -> None:
        """Fold one shard commit marker into the state (idempotent for the same marker); `checked_marker` first.
        Its encoded rows (a cold start's: one per catalogue item) go to the base's database as a table, not
        to `overlay` as objects."""
        encoded = marker.get("encoded", [])
        if encoded:
            for row in encoded:  # an item rejected by an earlier marker is encoded now: the newer row wins
                self.overlay.pop(row["item_id"], None)
            self.base.fold(rows_table(encoded, status=LIVE, shard=marker["shard"], run_id=marker["run_id"],
                                       updated_at=marker["created"]))
        for row in marker.get("rejected", []):
            row = dict(row)
            reason, transient = row.pop("reason"), row.pop("transient", False)
            self.overlay[row["item_id"]] = ItemState(status=FAILED if transient else REJECTED, shard=None,
                                                     run_id=marker["run_id"], reason=reason,
                                                     updated_at=marker["created"], **row)
        for row in marker.get("revived", []):  # back with the bytes its tombstone had: its old row serves again
            row = dict(row)
            shard = row.pop("shard")
            self.overlay[row["item_id"]] = ItemState(status=LIVE, shard=shard, run_id=marker["run_id"],
                                                     updated_at=marker["created"], **row)
        unchanged = marker.get("unchanged", [])  # signature moved, content hash did not
        known = self.rows([row["item_id"] for row in unchanged]) if unchanged else {}
        for row in unchanged:
            item = known.get(row["item_id"])
            if item is not None:
                item = self.overlay[row["item_id"]] = dataclasses.replace(item)
                item.etag, item.size, item.mtime = row["etag"], row["size"], row["mtime"]

    def delete(self, item_ids: list[str], run_id: str, stamp: str) -> None:
        """Tombstone these items; the tombstone keeps its shard, so that the same bytes coming back within
        TOMBSTONE_DAYS are revived from it."""
        for item_id, item in self.rows(item_ids).items():
            self.overlay[item_id] = dataclasses.replace(item, status=DELETED, run_id=run_id, updated_at=stamp,
                                                        reason=None)

    def to_table(self) -> pa.Table:
        """Every item as now, in item_id order (the whole state in memory: small stores, tests)."""
        return self.query("SELECT * FROM state ORDER BY item_id").cast(STATE_SCHEMA)

    def live_table(self) -> pa.Table:
        """The live items (STATE_SCHEMA), in item_id order."""
        return self.query(f"SELECT * FROM state WHERE status = '{LIVE}' ORDER BY item_id").cast(STATE_SCHEMA)


def list_snapshots(store: Location, slug: str) -> list[tuple[int, bool]]:
    """(seq, is_delta) of every snapshot, in order."""
    names = [n for n in store.list_names(snapshots_prefix(slug)) if n.endswith(".parquet")]
    return sorted((int(n.split(".")[0]), n.endswith(f"{DELTA}.parquet")) for n in names)


def latest_snapshot_seq(store: Location, slug: str) -> int:
    return max((seq for seq, _ in list_snapshots(store, slug)), default=0)


def latest_snapshot_key(store: Location, slug: str) -> str | None:
    snapshots = list_snapshots(store, slug)
    return snapshot_key(slug, *snapshots[-1]) if snapshots else None


def list_commits(store: Location, slug: str) -> list[str]:
    return [n[:-len(".json")] for n in store.list_names(commits_prefix(slug)) if n.endswith(".json")]


def load_state(store: Location, slug: str) -> CatalogueState:
    """The last committed state: the newest full snapshot, the deltas written after it (later wins), then every
    later shard commit, in run order. The snapshot files are read by DuckDB (in place on a local store, else
    downloaded to the state's folder); no row becomes a Python object."""
    snapshots = list_snapshots(store, slug)
    fulls = [seq for seq, delta in snapshots if not delta]
    full = fulls[-1] if fulls else 0
    wanted = [(seq, delta) for seq, delta in snapshots if seq >= full and (delta or seq == full)]
    base = StateBase()  # its folder caches the downloads; the table is made from them below
    keys = [snapshot_key(slug, seq, delta) for seq, delta in wanted]
    paths = [local_copy(store, key, base.folder, checksum="", suffix=".parquet") for key in keys]
    counts = [pq.read_metadata(path).num_rows for path in paths]
    seq = latest_snapshot_seq(store, slug)
    state = CatalogueState(slug=slug, seq=seq, base=base.load(paths))
    state.full_rows = sum(n for (_, delta), n in zip(wanted, counts) if not delta)
    state.delta_rows = sum(n for (_, delta), n in zip(wanted, counts) if delta)
    for shard in sorted(list_commits(store, slug)):
        if run_seq(shard_run_id(shard)) > seq:
            state.apply_commit(read_marker(store, slug, shard))
            state.pending.append(shard)
    return state


def write_snapshot(store: Location, state: CatalogueState, run_id: str, summary: dict) -> int:
    """Publish the state as the next snapshot (one atomic write), then drop the folded markers. The snapshot
    is a delta (the items changed since the state was loaded) while the deltas since the last full snapshot
    stay under COMPACT_SHARE of its rows; then a full one, streamed from DuckDB to a local file and uploaded.
    A nightly of 1% churn writes ~1% of the rows."""
    seq = run_seq(run_id)
    delta = bool(state.full_rows) and state.delta_rows + state.changed <= COMPACT_SHARE * state.full_rows
    metadata = {
        "imgest.run_id": run_id,
        "imgest.seq": str(seq),
        "imgest.kind": "delta" if delta else "full",
        "imgest.created": now_iso(),
        "imgest.summary": json.dumps(summary, sort_keys=True, default=str),
    }
    key = snapshot_key(state.slug, seq, delta)
    local = os.path.join(state.base.folder, f"out-{os.path.basename(key)}")
    with state.sql() as cur, one_thread(cur, SORT_MEMORY):  # a cold start's 10M folded rows sorted under the cap
        # (two threads' buffers ran out of 256 MB)
        rows = write_rows(cur.sql(f"SELECT * FROM {'overlay' if delta else 'state'} ORDER BY item_id")
                          .to_arrow_reader(65_536), local, metadata)
    try:
        store.put_file(key, local)
    finally:
        os.remove(local)
    for shard in list_commits(store, state.slug):
        if run_seq(shard_run_id(shard)) <= seq:
            store.delete(commit_key(state.slug, shard))
    if delta:
        state.delta_rows += rows
    else:
        state.full_rows, state.delta_rows = rows, 0
        try:  # housekeeping after the commit: a delete that fails now is retried after the next full snapshot
            prune_snapshots(store, state.slug, seq)
        except StorageError as exc:
            logging.getLogger("imgest").warning("old snapshots of model=%s not pruned: %s", state.slug, exc)
    state.seq, state.pending = seq, []
    return seq


def prune_snapshots(store: Location, slug: str, full_seq: int, now: datetime | None = None) -> list[str]:
    """Delete the snapshots (full and delta) that the full snapshot `full_seq` replaces, once older than
    SNAPSHOT_RETAIN_DAYS: the state never needs them again, and a nightly would otherwise grow the store by a
    snapshot a run for ever."""
    cutoff = (now or datetime.now(UTC)).timestamp() - SNAPSHOT_RETAIN_DAYS * 86400
    removed = []
    for seq, delta in list_snapshots(store, slug):
        key = snapshot_key(slug, seq, delta)
        if seq < full_seq and (store.modified(key) or cutoff) < cutoff:
            store.delete(key)
            removed.append(key)
    return removed


def forget_expired_tombstones(state: CatalogueState, now: datetime | None = None) -> None:
    """Tombstones older than TOMBSTONE_DAYS let go of their shard (in SQL over the committed rows: ISO times in
    UTC compare as strings). `now`: the time they are judged at (the wall clock when None), one for all of them."""
    now = now or datetime.now(UTC)
    cutoff = (now - timedelta(days=TOMBSTONE_DAYS)).isoformat(timespec="seconds")
    for item in state.overlay.values():
        if item.status == DELETED and item.shard and not revivable(item, now):
            item.shard = None
    if state.base.rows:  # the newly expired ones go to the overlay: the change a delta snapshot records
        expired = state.query(f"""SELECT * FROM kept WHERE status = '{DELETED}' AND shard IS NOT NULL
                                  AND NOT coalesce(content_hash IS NOT NULL AND updated_at > ?, false)""", [cutoff])
        for row in expired.to_pylist():
            state.overlay[row["item_id"]] = ItemState(**{**row, "shard": None})


def revivable(item: ItemState, now: datetime | None = None) -> bool:
    """A tombstone that still holds its last row (deleted less than TOMBSTONE_DAYS ago)."""
    if item.status != DELETED or not item.shard or not item.content_hash or not item.updated_at:
        return False
    age = (now or datetime.now(UTC)) - datetime.fromisoformat(item.updated_at)
    return age < timedelta(days=TOMBSTONE_DAYS)


def remove_orphan_shards(store: Location, state: CatalogueState, now: datetime | None = None) -> list[str]:
    """Delete shard files that no committed state refers to (left by a killed run, or superseded).

    Called with the store lock held, after load_state: every shard a live item needs is referenced, and
    so is every shard a recent tombstone could be revived from. Older tombstones forget their shard here
    (older at `now`: the wall clock when None).
    """
    forget_expired_tombstones(state, now)
    needed = set(state.query(f"""SELECT DISTINCT shard FROM state
                                 WHERE status IN ('{LIVE}', '{DELETED}') AND shard IS NOT NULL""")["shard"].to_pylist())
    needed.update(state.pending)
    removed = []
    for name in store.list_names(embeddings_prefix(state.slug), temp=True):
        stem = name[:-len(".parquet")] if name.endswith(".parquet") else None
        if name.startswith(TEMP_PREFIX) or (stem and stem not in needed):
            store.delete(file_in(embeddings_prefix(state.slug), name))
            removed.append(name)
    removed += pixels.remove_orphans(store, state.slug, needed)  # the shards' kept pixels follow them
    for folder in (commits_prefix(state.slug), snapshots_prefix(state.slug)):
        for name in store.list_names(folder, temp=True):  # a marker or snapshot killed before its rename
            if name.startswith(TEMP_PREFIX):
                store.delete(file_in(folder, name))
    return removed


def write_model_card(store: Location, spec_description: dict) -> None:
    key = f"{state_prefix(spec_description['slug'])}/model.json"
    if not store.exists(key):
        store.write_json_if(key, {**spec_description, "first_seen": now_iso()}, None)  # a racing writer's stands


def prepare_state(store: Location, spec_description: dict,
                  now: datetime | None = None) -> tuple[CatalogueState, list[str]]:
    """Under the store lock: record the model, load its committed state, drop unreferenced shards (tombstones
    expired at `now`, the wall clock when None, no longer keep theirs)."""
    write_model_card(store, spec_description)
    state = load_state(store, spec_description["slug"])
    return state, remove_orphan_shards(store, state, now)
