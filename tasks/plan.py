"""Compare a listing with the committed state: new, changed, unchanged, deleted; cut work into shards."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from imgest.defaults import DEFAULT_MAX_BYTES, DEFAULT_SHARD_SIZE
from imgest.storage import Location, ObjectInfo
from imgest.tasks.listing import Listing
from imgest.tasks.state import DELETED, FAILED, LIVE, CatalogueState, ItemState, revivable


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
    not_regular: int = 0
    new: int = 0
    changed_candidates: int = 0  # signature differs; bytes will tell whether content did
    unchanged: int = 0
    retried: int = 0  # failed last time for a transient reason: read again whatever their signature
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


class MassDeleteError(ValueError):
    """A run would tombstone more of the live items than allowed; nothing was changed."""


ARCHIVED = frozenset({"GLACIER", "DEEP_ARCHIVE"})  # unreadable until restored (GLACIER_IR reads at once)


def item_key(key: str) -> str:
    """The item id of a key: the key itself, or for a name that is not valid UTF-8 (a local file system
    hands those over with surrogate escapes) a printable stand-in that can be stored and shown."""
    try:
        key.encode("utf-8")
        return key
    except UnicodeEncodeError:
        return key.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def listing_verdict(obj: ObjectInfo, key: str, max_bytes: int) -> str | None:
    """Why an object (whose item id is `key`) is rejected from its listing alone, without reading it; None
    when it is to be read."""
    if key != obj.key:
        return f"KeyError: the key is not valid UTF-8 ({key!r}); rename the object"
    if obj.storage_class and obj.storage_class.upper() in ARCHIVED:
        return f"ArchivedObject: storage class {obj.storage_class} cannot be read until it is restored"
    if obj.size > max_bytes:
        return f"TooLarge: {obj.size} bytes, over max_bytes {max_bytes}"
    return None


def check_deletions(plan: Plan, state: CatalogueState, max_fraction: float) -> None:
    """Stop before anything is written when a run would tombstone more than `max_fraction` of the live
    items, or see an empty listing over a non-empty state: a wrong prefix or a half-synced bucket."""
    live = state.count(LIVE)
    gone = sum(1 for k in plan.deleted if state.items[k].status == LIVE)
    if live and (gone > max_fraction * live or plan.listed == 0):
        raise MassDeleteError(
            f"this run would tombstone {gone} of {live} live items ({gone / live:.0%}, over the allowed "
            f"{max_fraction:.0%}){' from an empty listing' if plan.listed == 0 else ''}: a wrong prefix or a "
            "half-synced bucket? Nothing was changed. If the deletions are real, run again with --allow-mass-delete")


def plan_ingest(listing: Listing, state: CatalogueState, run_id: str, shard_size: int = DEFAULT_SHARD_SIZE,
                max_bytes: int = DEFAULT_MAX_BYTES, max_delete_fraction: float | None = None) -> Plan:
    """Decide what to read. Unchanged objects (same signature) are never read.

    Rejected items are retried only when they change, failed ones (a transient reason) on every run;
    deleted ones come back as new, revived from their tombstone's row when the bytes are the same.
    `max_delete_fraction` (None: no limit) stops a run that would delete too much (MassDeleteError).
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    plan = Plan(run_id=run_id, listed=len(listing.objects), skipped=listing.skipped,
                not_regular=listing.not_regular)
    catalogue = Location(listing.catalogue)
    work: list[WorkItem] = []
    seen = set()
    for obj in listing.objects:
        key = item_key(obj.key)
        seen.add(key)
        prev = state.items.get(key)
        if prev is not None and prev.status not in (DELETED, FAILED) and same_signature(obj, prev):
            plan.unchanged += 1
            continue
        prev_hash = revive = None
        if prev is None or prev.status == DELETED:
            plan.new += 1
            if prev is not None and revivable(prev):
                prev_hash, revive = prev.content_hash, prev.shard
        elif prev.status == FAILED:
            plan.retried += 1
        else:
            plan.changed_candidates += 1
            prev_hash = prev.content_hash
        work.append(WorkItem(key, catalogue.uri(key), obj.size, obj.mtime, obj.etag, prev_hash,
                             verdict=listing_verdict(obj, key, max_bytes), revive_shard=revive))
    plan.deleted = sorted(k for k, item in state.items.items() if k not in seen and item.status != DELETED)
    if max_delete_fraction is not None:
        check_deletions(plan, state, max_delete_fraction)
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
