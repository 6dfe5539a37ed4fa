"""The evaluation flow: a labelled query set against one alias, or two compared; report and plots."""

from __future__ import annotations

import json

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from flows.naming import run_name
from imgest.storage import Location, open_location
from tasks.eval_report import render_eval
from tasks.evaluate import run_evaluation
from tasks.index_store import read_alias, read_card
from tasks.migration import record_evaluation
from tasks.plots import bootstrap_png, markdown_image, recall_sweep_png
from tasks.querysets import read_query_set

evaluate_task = task(run_evaluation, name="evaluate", cache_policy=NO_CACHE)


@flow(name="eval", flow_run_name=run_name("eval", "compare"), validate_parameters=True)
def evaluate(store: str, queries: str, alias: str = "serving", compare: str | None = None,
             ks: list[int] | None = None, resamples: int = 1000, seed: int = 0, out: str | None = None,
             device: str = "auto") -> dict:
    store_loc = open_location(store, must_exist=True, what="store")
    query_set = read_query_set(queries)
    report = evaluate_task(store_loc.url, query_set, alias, compare, ks or [1, 5, 10], resamples, seed, device)
    report["query_file"] = queries
    record_evaluation(store_loc, report)
    plots = plot_report(store_loc, report)
    markdown = render_eval(report) + "\n" + "\n\n".join(markdown_image(png, name) for name, png in plots.items())
    create_markdown_artifact(markdown, key="evaluation", description=f"eval {alias}"
                             + (f" vs {compare}" if compare else ""))
    create_table_artifact(metrics_table(report), key="evaluation-metrics", description="served and exact metrics")
    if out:
        target = Location(out)
        target.write_json("eval.json", report)
        target.write_bytes("eval.md", render_eval(report).encode())
        for name, png in plots.items():
            target.write_bytes(f"{name}.png", png)
    return report


def plot_report(store: Location, report: dict) -> dict[str, bytes]:
    plots = {}
    for side in ("a", "b"):
        if side in report:
            alias = read_alias(store, report[side]["alias"])
            card = read_card(store, alias["slug"], alias["version"])
            if card["search"]["param"]:
                plots[f"recall-sweep-{report[side]['alias']}"] = recall_sweep_png(card)
    if "compare" in report:
        metric = report["metric"]
        plots["bootstrap"] = bootstrap_png(report["compare"]["bootstrap"][metric], metric, report["a"]["alias"],
                                           report["b"]["alias"])
    return plots


def dumps(report: dict) -> str:
    return json.dumps(report, indent=2, default=str)


def metrics_table(report: dict) -> list[dict]:
    rows = []
    for side in ("a", "b"):
        if side in report:
            r = report[side]
            for how in ("metrics", "exact"):
                rows.append({"retriever": r["alias"], "model": r["slug"], "search": r["served"] if how == "metrics"
                             else "exact", **{k: round(v, 4) for k, v in r[how].items()}})
    return rows
