"""One new index version of a model, not yet written: updated in place, or trained, filled and tuned."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.utilities.annotations import quote

from imgest.config import IndexConfig
from imgest.reports.run_names import run_name
from imgest.tasks.index.steps import (
    card_task,
    choose_index_task,
    fallback_task,
    fill_and_tune,
    live_shards_task,
    previous_version_task,
    update_task,
)


@flow(name="build-version", flow_run_name=run_name("build-version"), validate_parameters=False)
def build_version(config: IndexConfig, model: dict) -> dict:
    """Update the version an alias serves when it is an IVF index whose training still fits the live vectors;
    otherwise train a new one (in this process, or in parts on the runner) and tune it to the target recall.
    Returns the version to write: the caller writes it under its lock (no lock token crosses into a run's
    parameters), after reuse was decided from the store's build records."""
    why, previous = "asked to build from scratch (--rebuild)", None
    if not config.rebuild:
        previous = previous_version_task(config.store, model["slug"])
        updated = update_task(config.store, model, previous, config.kind, config.memory, config.target_recall,
                              config.k, config.retrain_share, config.disk)
        if "why" not in updated:
            return {"built": True, **updated}
        why = updated["why"]
        get_run_logger().info("index model=%s: training a new index: %s", model["slug"], why)
    live = live_shards_task(config.store, model["slug"])
    if len(live) < 2:
        return {"built": False, "reason": f"{len(live)} live vectors: nothing to index", "slug": model["slug"]}
    d = int(model["dim"])
    choice = choose_index_task(len(live), d, config.memory, config.kind, config.disk, previous)
    built, tuned = fill_and_tune(config, model, live, choice)
    if not tuned.met and choice.instead_of:  # the updatable kind missed the target: the one it was picked over
        choice = fallback_task(choice, len(live), d, config.memory, config.disk, tuned)
        get_run_logger().info("index model=%s: %s", model["slug"], choice.reason)
        built, tuned = fill_and_tune(config, model, live, choice)
    card = card_task(model, quote(built), choice, config.memory, tuned, config.retrain_share, why, config.runner,
                     config.disk)
    return {"built": True, "index": built.index, "ids": built.ids, "truth": built.truth.to_table(), "card": card,
            "reference": built.reference}

