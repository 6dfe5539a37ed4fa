"""Store status: per model, live items, shards, rejects, tombstones, snapshot and last run; who is writing."""

from __future__ import annotations

from imgest.lock import current_holder
from imgest.storage import Location, open_location
from imgest.tasks.models import list_models
from imgest.tasks.state import DELETED, FAILED, LIVE, REJECTED, latest_snapshot_seq, load_state


def last_run(store: Location, slug: str) -> dict | None:
    runs = [n for n in store.list_names("runs") if n.endswith(".json")]
    for name in sorted(runs, reverse=True):
        summary = store.read_json(f"runs/{name}")
        if summary.get("slug") == slug:
            return {k: v for k, v in summary.items() if k not in ("rejected_items", "removed_orphans", "parameters")}
    return None


def model_status(store: Location, card: dict) -> dict:
    slug = card["slug"]
    state = load_state(store, slug)
    items = state.items.values()
    live_shards = {i.shard for i in items if i.status == LIVE}
    return {
        "name": card["name"],
        "model_id": card["model_id"],
        "slug": slug,
        "dim": card["dim"],
        "live": sum(1 for i in items if i.status == LIVE),
        "shards": len(live_shards),
        "rejected": [{"item_id": i.item_id, "reason": i.reason} for i in sorted(items, key=lambda i: i.item_id)
                     if i.status == REJECTED],
        "failed": [{"item_id": i.item_id, "reason": i.reason} for i in sorted(items, key=lambda i: i.item_id)
                   if i.status == FAILED],  # transient: read again on the next run
        "tombstones": sum(1 for i in items if i.status == DELETED),
        "snapshot": latest_snapshot_seq(store, slug),
        "pending_shards": len(state.pending),  # committed by a run that did not finish; folded next run
        "last_run": last_run(store, slug),
    }


def store_status(store_url: str) -> dict:
    store = open_location(store_url, must_exist=True, what="store")
    lock = current_holder(store)
    return {
        "store": store.url,
        "running": {k: lock[k] for k in ("owner", "host", "pid", "started")} if lock else None,
        "models": [model_status(store, card) for card in list_models(store)],
    }
