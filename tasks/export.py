"""Read side of the store: per-model status, and export of the live embeddings as one Parquet file."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from imgest.lock import LOCK_KEY
from imgest.storage import Location, open_location
from tasks.live import iter_live_tables
from tasks.state import DELETED, LIVE, REJECTED, latest_snapshot_seq, list_models, load_state


class ModelNotFoundError(LookupError):
    """The store has no model of that name; the message lists the ones it has."""


def find_model(store: Location, model: str) -> dict:
    """Match a model by slug, model id or name (``efficientnet-lite0``), among those in the store."""
    models = list_models(store)
    exact = [m for m in models if model in (m["slug"], m["model_id"])]
    by_name = [m for m in models if m["name"] == model]
    found = exact or by_name
    if len(found) == 1:
        return found[0]
    have = ", ".join(f"{m['name']} ({m['slug']})" for m in models) or "none"
    if not found:
        raise ModelNotFoundError(f"store {store.url} has no model {model!r}; models in the store: {have}")
    raise ModelNotFoundError(f"model {model!r} is ambiguous in {store.url} (weights changed between runs); "
                             f"name one by its slug: {have}")


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
        "tombstones": sum(1 for i in items if i.status == DELETED),
        "snapshot": latest_snapshot_seq(store, slug),
        "pending_shards": len(state.pending),  # committed by a run that did not finish; folded next run
        "last_run": last_run(store, slug),
    }


def store_status(store_url: str) -> dict:
    store = open_location(store_url, must_exist=True, what="store")
    lock = store.read_json(LOCK_KEY) if store.exists(LOCK_KEY) else None
    return {
        "store": store.url,
        "running": {k: lock[k] for k in ("owner", "host", "pid", "started")} if lock else None,
        "models": [model_status(store, card) for card in list_models(store)],
    }


def export_live(store_url: str, model: str, out: str) -> dict:
    """One row per live item, written shard by shard so memory holds one shard at a time."""
    store = open_location(store_url, must_exist=True, what="store")
    card = find_model(store, model)
    state = load_state(store, card["slug"])
    target = Location(out)
    rows = 0
    with target.open_output("") as fh:
        writer = None
        for table in iter_live_tables(store, state):
            if writer is None:
                writer = pq.ParquetWriter(fh, table.schema, compression="zstd")
            writer.write_table(table.cast(writer.schema))
            rows += table.num_rows
        if writer is None:  # an empty export still has the right columns
            writer = pq.ParquetWriter(fh, _empty_schema(card), compression="zstd")
        writer.close()
    return {"model_id": card["model_id"], "slug": card["slug"], "rows": rows, "out": target.url}


def _empty_schema(card: dict) -> pa.Schema:
    return pa.schema([("item_id", pa.string()), ("uri", pa.string()), ("content_hash", pa.string()),
                      ("model_id", pa.string()), ("embedding", pa.list_(pa.float32(), int(card["dim"])))],
                     metadata={"imgest.model_id": card["model_id"], "imgest.dim": str(card["dim"])})
