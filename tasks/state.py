"""Per-model catalogue state: the last snapshot plus shard commits not yet folded into one.

Layout below the store (``<slug>`` names one model id):
  embeddings/model=<slug>/part-<run>-<NNNNN>.parquet   shard data, written before its commit marker
  state/model=<slug>/commits/part-<run>-<NNNNN>.json   shard commit marker, written last
  state/model=<slug>/snapshots/<seq>.parquet           full catalogue state after a run
  state/model=<slug>/model.json                        what the encoder is
A shard is visible only once its marker exists; a snapshot folds markers in and is itself one PUT.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pyarrow as pa

from imgest.storage import TEMP_PREFIX, Location

# live: a current embedding; rejected: this content cannot be used (retried when the object changes);
# failed: a transient fault (timeout, throttling, memory): retried on the next run; deleted: a tombstone,
# which keeps its last shard for TOMBSTONE_DAYS so that an item coming back with the same bytes is revived.
LIVE, REJECTED, FAILED, DELETED = "live", "rejected", "failed", "deleted"
TOMBSTONE_DAYS = 30

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


def embeddings_prefix(slug: str) -> str:
    return f"embeddings/model={slug}"


def shard_key(slug: str, shard: str) -> str:
    return f"{embeddings_prefix(slug)}/{shard}.parquet"


def state_prefix(slug: str) -> str:
    return f"state/model={slug}"


def commit_key(slug: str, shard: str) -> str:
    return f"{state_prefix(slug)}/commits/{shard}.json"


def snapshot_key(slug: str, seq: int) -> str:
    return f"{state_prefix(slug)}/snapshots/{seq:08d}.parquet"


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def new_run_id(seq: int) -> str:
    """Sortable: snapshot sequence first, so a rerun after a crash sorts after the crashed run."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    return f"r{seq:08d}-{stamp}-{secrets.token_hex(3)}"


def run_seq(run_id: str) -> int:
    return int(run_id[1:9])


def shard_run_id(shard: str) -> str:
    # part-<run_id>-<NNNNN>
    return shard[len("part-"):].rsplit("-", 1)[0]


@dataclass
class CatalogueState:
    slug: str
    items: dict[str, ItemState]
    seq: int = 0  # sequence of the snapshot this state started from
    pending: list[str] = dataclasses.field(default_factory=list)  # commit markers applied on top

    def count(self, status: str) -> int:
        return sum(1 for item in self.items.values() if item.status == status)

    def live(self) -> list[ItemState]:
        return [item for item in self.items.values() if item.status == LIVE]

    def apply_commit(self, marker: dict) -> None:
        """Fold one shard commit marker into the state (idempotent for the same marker)."""
        for row in marker.get("encoded", []):
            self.items[row["item_id"]] = ItemState(status=LIVE, shard=marker["shard"], run_id=marker["run_id"],
                                                   updated_at=marker["created"], **row)
        for row in marker.get("rejected", []):
            row = dict(row)
            reason, transient = row.pop("reason"), row.pop("transient", False)
            self.items[row["item_id"]] = ItemState(status=FAILED if transient else REJECTED, shard=None,
                                                   run_id=marker["run_id"], reason=reason,
                                                   updated_at=marker["created"], **row)
        for row in marker.get("revived", []):  # back with the bytes its tombstone had: its old row serves again
            row = dict(row)
            shard = row.pop("shard")
            self.items[row["item_id"]] = ItemState(status=LIVE, shard=shard, run_id=marker["run_id"],
                                                   updated_at=marker["created"], **row)
        for row in marker.get("unchanged", []):  # signature moved, content hash did not
            item = self.items.get(row["item_id"])
            if item is not None:
                item.etag, item.size, item.mtime = row["etag"], row["size"], row["mtime"]

    def to_table(self) -> pa.Table:
        rows = [dataclasses.asdict(item) for item in sorted(self.items.values(), key=lambda i: i.item_id)]
        return pa.Table.from_pylist(rows, schema=STATE_SCHEMA)


def latest_snapshot_seq(store: Location, slug: str) -> int:
    names = [n for n in store.list_names(f"{state_prefix(slug)}/snapshots") if n.endswith(".parquet")]
    return max((int(n.split(".")[0]) for n in names), default=0)


def list_commits(store: Location, slug: str) -> list[str]:
    return [n[:-len(".json")] for n in store.list_names(f"{state_prefix(slug)}/commits") if n.endswith(".json")]


def load_state(store: Location, slug: str) -> CatalogueState:
    """The last committed state: newest snapshot plus every later shard commit, in run order."""
    seq = latest_snapshot_seq(store, slug)
    items: dict[str, ItemState] = {}
    if seq:
        for row in store.read_table(snapshot_key(slug, seq)).to_pylist():
            items[row["item_id"]] = ItemState(**row)
    state = CatalogueState(slug=slug, items=items, seq=seq)
    for shard in sorted(list_commits(store, slug)):
        if run_seq(shard_run_id(shard)) > seq:
            state.apply_commit(store.read_json(commit_key(slug, shard)))
            state.pending.append(shard)
    return state


def write_snapshot(store: Location, state: CatalogueState, run_id: str, summary: dict) -> int:
    """Publish the state as the next snapshot (one atomic write), then drop the folded markers."""
    seq = run_seq(run_id)
    table = state.to_table().replace_schema_metadata({
        "imgest.run_id": run_id,
        "imgest.seq": str(seq),
        "imgest.created": now_iso(),
        "imgest.summary": json.dumps(summary, sort_keys=True, default=str),
    })
    store.write_table(snapshot_key(state.slug, seq), table)
    for shard in list_commits(store, state.slug):
        if run_seq(shard_run_id(shard)) <= seq:
            store.delete(commit_key(state.slug, shard))
    state.seq, state.pending = seq, []
    return seq


def revivable(item: ItemState, now: datetime | None = None) -> bool:
    """A tombstone that still holds its last row (deleted less than TOMBSTONE_DAYS ago)."""
    if item.status != DELETED or not item.shard or not item.content_hash or not item.updated_at:
        return False
    age = (now or datetime.now(UTC)) - datetime.fromisoformat(item.updated_at)
    return age < timedelta(days=TOMBSTONE_DAYS)


def remove_orphan_shards(store: Location, state: CatalogueState) -> list[str]:
    """Delete shard files that no committed state refers to (left by a killed run, or superseded).

    Called with the store lock held, after load_state: every shard a live item needs is referenced, and
    so is every shard a recent tombstone could be revived from. Older tombstones forget their shard here.
    """
    for item in state.items.values():
        if item.status == DELETED and item.shard and not revivable(item):
            item.shard = None
    needed = {item.shard for item in state.items.values() if item.status in (LIVE, DELETED) and item.shard}
    needed.update(state.pending)
    removed = []
    for name in store.list_names(embeddings_prefix(state.slug), temp=True):
        stem = name[:-len(".parquet")] if name.endswith(".parquet") else None
        if name.startswith(TEMP_PREFIX) or (stem and stem not in needed):
            store.delete(f"{embeddings_prefix(state.slug)}/{name}")
            removed.append(name)
    for folder in (f"{state_prefix(state.slug)}/commits", f"{state_prefix(state.slug)}/snapshots"):
        for name in store.list_names(folder, temp=True):  # a marker or snapshot killed before its rename
            if name.startswith(TEMP_PREFIX):
                store.delete(f"{folder}/{name}")
    return removed


def write_model_card(store: Location, spec_description: dict) -> None:
    key = f"{state_prefix(spec_description['slug'])}/model.json"
    if not store.exists(key):
        store.write_json(key, {**spec_description, "first_seen": now_iso()})


def prepare_state(store: Location, spec_description: dict) -> tuple[CatalogueState, list[str]]:
    """Under the store lock: record the model, load its committed state, drop unreferenced shards."""
    write_model_card(store, spec_description)
    state = load_state(store, spec_description["slug"])
    return state, remove_orphan_shards(store, state)
