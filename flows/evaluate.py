"""The evaluation flow: a labelled query set against one alias, or two compared, or candidate models weighed against
its model; report and plots."""

from __future__ import annotations

import hashlib

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from imgest.config import EvalConfig
from imgest.config.flow_params import configured_flow
from imgest.plots import markdown_image
from imgest.reports.evaluation import candidates_table, render_eval
from imgest.reports.run_names import run_name
from imgest.retrieval.querysets import read_query_set
from imgest.state.lock import LOCK_WAIT_S, StoreLock, run_owner
from imgest.storage import open_location, read_url
from imgest.tasks.evaluate.candidates import compare_candidates_task
from imgest.tasks.evaluate.retrievers import evaluate_task, metrics_table, plot_report, write_outputs
from imgest.tasks.migration.window import evaluates_window, record_evaluation


@configured_flow(name="eval", flow_run_name=run_name("eval", "compare"))
def evaluate(config: EvalConfig) -> dict:
    store_loc = open_location(config.store, must_exist=True, what="store")
    query_set = read_query_set(config.queries)
    report = evaluate_task(store_loc.url, query_set, config.alias, config.compare, list(config.ks), config.resamples,
                           config.seed,
                           config.device, config.traffic)
    if config.candidates:
        report["candidates"] = compare_candidates_task(store_loc.url, query_set, config.alias, list(config.candidates),
                                                       list(config.ks), config.candidate_sample, config.seed,
                                                       config.resamples, config.device, config.catalogue)
        create_table_artifact(candidates_table(report["candidates"]), key="candidates",
                              description=f"candidate models against {config.alias}'s, on one sample")
    report["query_file"] = config.queries
    report["query_sha256"] = hashlib.sha256(read_url(config.queries)).hexdigest()
    if evaluates_window(store_loc, report):  # serving vs shadow in an open window: kept for status and the gate
        with StoreLock(store_loc, owner=run_owner("eval"), wait=LOCK_WAIT_S) as lock:
            record_evaluation(store_loc, report, lock.fence)
    plots = plot_report(store_loc, report)
    markdown = render_eval(report)
    create_markdown_artifact(markdown + "\n" + "\n\n".join(markdown_image(png, name) for name, png in plots.items()),
                             key="evaluation",
                             description=f"eval {config.alias}" + (f" vs {config.compare}" if config.compare else ""))
    create_table_artifact(metrics_table(report), key="evaluation-metrics", description="served and exact metrics")
    if config.out:
        write_outputs(config.out, report, markdown, plots)
    return report
