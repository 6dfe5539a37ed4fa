"""Exact and near-duplicate images of one image model: a Parquet report in the store and an artifact."""

from __future__ import annotations

from prefect.artifacts import create_markdown_artifact

from imgest.config import DuplicatesConfig
from imgest.config.flow_params import configured_flow
from imgest.reports.run_names import run_name
from imgest.state.lock import LOCK_WAIT_S, StoreLock, run_owner
from imgest.storage import open_location
from imgest.tasks.duplicates.find import choose_task, find_task


@configured_flow(name="duplicates", flow_run_name=run_name("duplicates", None))
def duplicates(config: DuplicatesConfig) -> dict:
    store_loc = open_location(config.store, must_exist=True, what="store")
    with StoreLock(store_loc, owner=run_owner("duplicates"), wait=LOCK_WAIT_S) as lock:
        alias = None if config.model else config.alias
        choice = choose_task(store_loc.url, alias, config.model, config.threshold, config.calibrate,
                             config.calibration_sample, config.calibration_recall, lock.fence)
        report = find_task(store_loc.url, alias, config.model, choice, lock.fence)
    create_markdown_artifact(report.pop("markdown"), key="duplicates",
                             description=f"duplicates model={report['slug']}")
    return report
