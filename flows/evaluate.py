"""The evaluation flow: a labelled query set against one alias, or two compared; report and plots."""

from __future__ import annotations

import hashlib
import os
import socket

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from imgest.config import EvalConfig
from imgest.defaults import DEFAULT_DEVICE, DEFAULT_KS, DEFAULT_RESAMPLES
from imgest.lock import LOCK_WAIT_S, StoreLock
from imgest.storage import open_location, read_url
from imgest.tasks.evaluate import evaluate_task, metrics_table, plot_report, write_outputs
from imgest.tasks.markdown import render_eval
from imgest.tasks.migration import evaluates_window, record_evaluation
from imgest.tasks.plots import markdown_image
from imgest.tasks.querysets import read_query_set
from imgest.tasks.run_names import run_name


@flow(name="eval", flow_run_name=run_name("eval", "compare"), validate_parameters=True)
def evaluate(store: str, queries: str, alias: str = "serving", compare: str | None = None,
             ks: list[int] | None = None, resamples: int = DEFAULT_RESAMPLES, seed: int = 0, out: str | None = None,
             device: str = DEFAULT_DEVICE, traffic: str | None = None) -> dict:
    cfg = EvalConfig(store=store, queries=queries, alias=alias, compare=compare,
                     ks=tuple(DEFAULT_KS if ks is None else ks), resamples=resamples, seed=seed, out=out,
                     device=device, traffic=traffic)
    store_loc = open_location(cfg.store, must_exist=True, what="store")
    query_set = read_query_set(cfg.queries)
    report = evaluate_task(store_loc.url, query_set, cfg.alias, cfg.compare, list(cfg.ks), cfg.resamples, cfg.seed,
                           cfg.device, cfg.traffic)
    report["query_file"] = cfg.queries
    report["query_sha256"] = hashlib.sha256(read_url(cfg.queries)).hexdigest()
    if evaluates_window(store_loc, report):  # serving vs shadow in an open window: kept for status and the gate
        with StoreLock(store_loc, owner=f"eval@{socket.gethostname()}:{os.getpid()}", wait=LOCK_WAIT_S) as lock:
            record_evaluation(store_loc, report, lock.fence)
    plots = plot_report(store_loc, report)
    markdown = render_eval(report)
    create_markdown_artifact(markdown + "\n" + "\n\n".join(markdown_image(png, name) for name, png in plots.items()),
                             key="evaluation",
                             description=f"eval {cfg.alias}" + (f" vs {cfg.compare}" if cfg.compare else ""))
    create_table_artifact(metrics_table(report), key="evaluation-metrics", description="served and exact metrics")
    if cfg.out:
        write_outputs(cfg.out, report, markdown, plots)
    return report
