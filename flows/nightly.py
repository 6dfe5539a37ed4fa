"""The nightly job: ingest what changed, then build fresh indexes; during a migration window, for both models."""

from __future__ import annotations

from prefect.artifacts import create_markdown_artifact

from imgest import encoders
from imgest.config import DuplicatesConfig, NightlyConfig, SyncConfig
from imgest.config.flow_params import configured_flow
from imgest.flows.build_index import build_index
from imgest.flows.duplicates import duplicates
from imgest.flows.ingest import ingest
from imgest.images import decoders
from imgest.memory import give_back
from imgest.reports.nightly import render_nightly
from imgest.reports.run_names import run_name
from imgest.state.lock import StoreLock, run_owner
from imgest.state.retention import collect_retired
from imgest.storage import open_location
from imgest.tasks.migration.window import check_window_model, nightly_models
from imgest.tasks.sync.run import sync_task
from imgest.tasks.sync.targets import parse_target
from imgest.tasks.sync.window import window_companions
from imgest.tasks.watch.steps import drift_task, record_night_task, trend_artifact_task


@configured_flow(name="nightly", flow_run_name=run_name("nightly", None))
def nightly(config: NightlyConfig) -> dict:
    store_loc = open_location(config.store)
    for target in config.sync_to:  # a bad target URL refuses the night before it starts, not after its builds
        parse_target(target)
    runs, bases, ingested = [], [], set()
    models, left_out = nightly_models(store_loc, config.model)
    device = encoders.resolve_device(config.device)
    for name, expected_slug in models:  # a window's model whose weights changed refuses the night before any commit
        spec = encoders.resolve(name)
        check_window_model(expected_slug, spec)
        if "image" in spec.modalities:  # and so does a model whose recorded JPEG decoder cannot run here
            decoders.check(store_loc, spec.slug, config.decoder, config.force_decoder, device)
    for name, _ in models:
        base = encoders.resolve(name).base
        if base is not None and base.slug not in ingested:
            # A head: its base model first, so new images are decoded and encoded once, into the base's
            # namespace, and the head derives every row from there. The base stays current for retraining
            # the head and for comparing against it; it gets no index of its own unless an alias is on it.
            base_summary = ingest(config.ingest(base.name))
            ingested.add(base_summary["slug"])
            bases.append(base_summary)
        summary = ingest(config.ingest(name))
        drift = drift_task(store_loc.url, summary["slug"], summary["run_id"])  # against the index before tonight's
        index = build_index(config.index(summary["slug"]))
        ingested.add(summary["slug"])
        night = record_night_task(store_loc.url, summary, index, drift)  # the trend row, marked; events emitted
        runs.append({"ingest": summary, "index": index, "night": night})
    # models retired by a finished migration window go once their retention has passed and no alias needs them
    with StoreLock(store_loc, owner=run_owner("nightly-retire")) as lock:
        retired = collect_retired(store_loc, lock.fence)
    found = None
    if config.report_duplicates and runs:  # the serving model's duplicate groups, new ones since the last report
        give_back()  # the builds' freed memory, before the search over every live item
        found = duplicates(DuplicatesConfig(store=config.store, alias="serving"))
        found.pop("groups")
    if runs:
        trend_artifact_task(store_loc.url)
    # each target: the serving model (its name answers for it), then during a window the other model, into its own
    companions = window_companions(store_loc)
    if config.sync_to:
        give_back()  # what the builds and the duplicates freed, before the sync reads the live set
    synced = [sync_task(SyncConfig(store=config.store, to=target, **which)) for target in config.sync_to
              for which in ({"alias": "serving"}, *({"model": slug} for slug in companions))]
    base_rows = [{"ingest": b, "index": {"built": False, "reason": "base of a head"}} for b in bases]
    create_markdown_artifact(render_nightly(base_rows + runs, retired, left_out, found, synced), key="nightly-summary",
                             description=f"nightly {store_loc.url}")
    return {**(runs[0] if runs else {}), "models": runs, "bases": bases, "retired": retired, "left_out": left_out,
            "duplicates": found, "synced": synced}
