"""The watch tasks of a nightly: record each model's night (marked against its recent nights, events emitted)
and publish the trend artifact."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from imgest.events import night_events
from imgest.redact import redact_url
from imgest.storage import Location
from imgest.tasks.watch.drift import night_drift
from imgest.tasks.watch.history import night_row, read_history, record_night
from imgest.tasks.watch.outliers import unusual
from imgest.tasks.watch.trend import render_trend

TREND_NIGHTS = 30


def watch_night(store_url: str, ingest: dict, index: dict, drift: dict | None = None) -> dict:
    """The night's row, marked against the model's earlier nights, written once, its events emitted."""
    store = Location(store_url)
    row = night_row(ingest, index, store, drift)
    row["marks"] = unusual(row, read_history(store, row["slug"], TREND_NIGHTS))
    row["key"] = record_night(store, row)
    row["events"] = night_events(row, store_url)
    return row


@task(name="record-night", cache_policy=NO_CACHE)  # no retries: a retried night would emit its events twice
def record_night_task(store_url: str, ingest: dict, index: dict, drift: dict | None = None) -> dict:
    return watch_night(store_url, ingest, index, drift)


@task(name="measure-drift", cache_policy=NO_CACHE)
def drift_task(store_url: str, slug: str, run_id: str) -> dict | None:
    return night_drift(Location(store_url), slug, run_id)


@task(name="nightly-trend", cache_policy=NO_CACHE)
def trend_artifact_task(store_url: str) -> str:
    markdown = render_trend(read_history(Location(store_url), nights=TREND_NIGHTS))
    create_markdown_artifact(markdown, key="nightly-trend", description=f"last nights of {redact_url(store_url)}")
    return markdown
