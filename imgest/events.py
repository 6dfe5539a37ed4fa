"""The events imgest emits to Prefect, all named `imgest.*`: each about one model of one store (the event's
resource), with its figures in the payload, for automations and the UI's event feed (docs/alerts.md)."""

from __future__ import annotations

from prefect.context import FlowRunContext, TaskRunContext
from prefect.events import emit_event

from imgest.redact import redact_url

EVENTS = {
    "imgest.recall.below-target": "served recall@k of the new index version is below its target",
    "imgest.rejected.high": "rejected images far above their recent median",
    "imgest.throughput.low": "images/s far below the recent median",
    "imgest.ingest.slow": "ingest wall time far above its recent median",
    "imgest.drift.high": "new images far from what the serving index was trained on",
    "imgest.delete.refused": "a run that would have tombstoned too much of the catalogue stopped before writing",
    "imgest.index.retrained": "an index version trained anew instead of updated in place, with the reason",
    "imgest.migration.opened": "a migration window opened",
    "imgest.migration.promoted": "serving moved to the new model",
    "imgest.migration.rolled-back": "serving moved back to the old model",
    "imgest.migration.finished": "a migration window closed; the retired model is scheduled for deletion",
}
DRIFT_ADVICE = ("the new images sit far from what the serving index was trained on: retrain the index "
                "(imgest build-index --rebuild) so its partitions cover them, and evaluate the model on recent "
                "queries (imgest eval) before trusting its results on them")
MARKS = {"rejected_share": "imgest.rejected.high", "images_per_second": "imgest.throughput.low",
         "seconds.ingest": "imgest.ingest.slow", "drift.score": "imgest.drift.high"}  # outliers.RULES -> event


def model_resource(store_url: str, slug: str) -> dict[str, str]:
    store = redact_url(store_url)
    return {"prefect.resource.id": f"imgest.model.{slug}", "prefect.resource.name": f"{slug} in {store}",
            "imgest.store": store, "imgest.model": slug}


def emit(name: str, store_url: str, slug: str, payload: dict) -> None:
    """Emit one of EVENTS (any other name is a mistake here, not a new event), from inside a flow or task run,
    whose resources Prefect relates it to."""
    if name not in EVENTS:
        raise ValueError(f"unknown imgest event {name!r}; known: {', '.join(EVENTS)}")
    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return  # called outside a run (a script, a unit test): no server to tell, and none is started for it
    emit_event(event=name, resource=model_resource(store_url, slug),
               payload={"summary": EVENTS[name], "store": redact_url(store_url), "model": slug, **payload})


def night_events(row: dict, store_url: str) -> list[str]:
    """The events a night's history row calls for; emitted, and their names returned."""
    emitted = []
    base = {"date": row["date"], "run_id": row["run_id"], "model_id": row["model_id"]}
    for mark in row.get("marks", []):
        if mark["figure"] == "drift.score":
            continue  # the drift event below carries the whole measurement and the advice
        name = MARKS[mark["figure"]]
        emit(name, store_url, row["slug"], {**base, **mark})
        emitted.append(name)
    recall, index = row.get("recall"), row.get("index")
    if recall and not recall["met"] and not (index or {}).get("reused"):
        emit("imgest.recall.below-target", store_url, row["slug"], {**base, **recall, "version": index["version"]})
        emitted.append("imgest.recall.below-target")
    drift = row.get("drift")
    if drift and (drift["high"] or "drift.score" in {m["figure"] for m in row.get("marks", [])}):
        emit("imgest.drift.high", store_url, row["slug"], {**base, **drift, "advice": DRIFT_ADVICE})
        emitted.append("imgest.drift.high")
    if index and index["method"] == "build" and index["version"] > 1 and "IVF" in index["factory"]:
        # only IVF versions are carried forward in place; Flat and HNSW are built anew by design
        emit("imgest.index.retrained", store_url, row["slug"],
             {**base, "version": index["version"], "factory": index["factory"], "why": index["why"]})
        emitted.append("imgest.index.retrained")
    return emitted
