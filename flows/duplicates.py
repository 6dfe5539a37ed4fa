"""Exact and near-duplicate images of one image model: a Parquet report in the store and an artifact."""

from __future__ import annotations

import os
import socket

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from imgest.config import DuplicatesConfig
from imgest.defaults import DEFAULT_DUPLICATE_THRESHOLD
from imgest.lock import LOCK_WAIT_S, StoreLock
from imgest.storage import open_location
from imgest.tasks.duplicates import find_duplicates_task
from imgest.tasks.run_names import run_name


@flow(name="duplicates", flow_run_name=run_name("duplicates", None), validate_parameters=True)
def duplicates(store: str, alias: str | None = "serving", model: str | None = None,
               threshold: float = DEFAULT_DUPLICATE_THRESHOLD) -> dict:
    cfg = DuplicatesConfig(store=store, alias=alias, model=model, threshold=threshold)
    store_loc = open_location(cfg.store, must_exist=True, what="store")
    with StoreLock(store_loc, owner=f"duplicates@{socket.gethostname()}:{os.getpid()}", wait=LOCK_WAIT_S) as lock:
        report = find_duplicates_task(store_loc.url, None if cfg.model else cfg.alias, cfg.model, cfg.threshold,
                                      lock.fence)
    create_markdown_artifact(report.pop("markdown"), key="duplicates",
                             description=f"duplicates model={report['slug']}")
    return report
