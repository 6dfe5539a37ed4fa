"""Compare a listing with the committed state: new, changed, unchanged, deleted; cut work into shards."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from prefect import task
from prefect.cache_policies import NO_CACHE

from imgest.storage import Location, ObjectInfo
from imgest.tasks.listing import Listing
from imgest.tasks.state import DELETED, LIVE, CatalogueState, ItemState


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


@dataclass(frozen=True)
class ShardPlan:
    run_id: str
    index: int
    items: tuple[WorkItem, ...]

    @property
    def name(self) -> str:
        return f"part-{self.run_id}-{self.index:05d}"


@dataclass
class Plan:
    run_id: str
    listed: int
    skipped: int
    new: int = 0
    changed_candidates: int = 0  # signature differs; bytes will tell whether content did
    unchanged: int = 0
    deleted: list[str] = field(default_factory=list)
    shards: list[ShardPlan] = field(default_factory=list)

    @property
    def to_read(self) -> int:
        return sum(len(s.items) for s in self.shards)


def same_signature(obj: ObjectInfo, prev: ItemState) -> bool:
    """ETag when both sides have one (object stores), otherwise size and mtime (file systems)."""
    if obj.etag and prev.etag:
        return obj.etag == prev.etag and obj.size == prev.size
    return obj.size == prev.size and obj.mtime is not None and prev.mtime is not None \
        and abs(obj.mtime - prev.mtime) < 1e-6


def plan_ingest(listing: Listing, state: CatalogueState, run_id: str, shard_size: int = 2000) -> Plan:
    """Decide what to read. Unchanged objects (same signature) are never read.

    Rejected items are retried only when they change; deleted ones come back as new.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    plan = Plan(run_id=run_id, listed=len(listing.objects), skipped=listing.skipped)
    catalogue = Location(listing.catalogue)
    work: list[WorkItem] = []
    seen = set()
    for obj in listing.objects:
        seen.add(obj.key)
        prev = state.items.get(obj.key)
        if prev is not None and prev.status != DELETED and same_signature(obj, prev):
            plan.unchanged += 1
            continue
        if prev is None or prev.status == DELETED:
            plan.new += 1
            prev_hash = None
        else:
            plan.changed_candidates += 1
            prev_hash = prev.content_hash
        work.append(WorkItem(obj.key, catalogue.uri(obj.key), obj.size, obj.mtime, obj.etag, prev_hash))
    plan.deleted = sorted(k for k, item in state.items.items() if k not in seen and item.status != DELETED)
    plan.shards = [
        ShardPlan(run_id, i, tuple(work[start:start + shard_size]))
        for i, start in enumerate(range(0, len(work), shard_size))
    ]
    return plan


def attach_base(plan: Plan, base: CatalogueState) -> Plan:
    """For a head model: every planned item whose base-model embedding is current (live, same signature)
    is marked to be derived from it (the head applied to the stored vector) instead of read and decoded."""
    shards = []
    for shard in plan.shards:
        items = []
        for item in shard.items:
            prev = base.items.get(item.item_id)
            obj = ObjectInfo(item.item_id, item.size, item.mtime, item.etag)
            if prev is not None and prev.status == LIVE and prev.shard and same_signature(obj, prev):
                item = replace(item, base_shard=prev.shard, base_hash=prev.content_hash)
            items.append(item)
        shards.append(replace(shard, items=tuple(items)))
    plan.shards = shards
    return plan


@task(name="plan-shards", cache_policy=NO_CACHE)
def plan_ingest_task(listing: Listing, state: CatalogueState, run_id: str, shard_size: int) -> Plan:
    return plan_ingest(listing, state, run_id, shard_size)


@task(name="attach-base-embeddings", cache_policy=NO_CACHE)
def attach_base_task(store_url: str, base_slug: str, plan: Plan) -> Plan:
    from imgest.tasks.state import load_state

    return attach_base(plan, load_state(Location(store_url), base_slug))
