"""Commands: eval, queries class/instance, report cost."""

from __future__ import annotations

import json
from typing import Optional

import typer

from imgest.cli.app import app, fail
from imgest.cli.options import config_command
from imgest.config import EvalConfig
from imgest.errors import USER_ERRORS
from imgest.names import DEFAULT_DEVICE


@app.command("eval")
@config_command(EvalConfig)
def eval_cmd(config: EvalConfig, as_json: bool = typer.Option(False, "--json")) -> None:
    """recall@K, precision@K, MRR, mAP at the served parameters and exact, per class; A vs B when compared; with
    --candidates, candidate models against A's on one sample: recall, paired interval, encode cost."""
    try:
        from imgest.retrieval.querysets import read_query_set

        # a malformed set or traffic file fails before Prefect starts
        read_query_set(config.queries)
        if config.traffic:
            from imgest.retrieval.routing import read_traffic

            read_traffic(config.traffic)
        from imgest.flows.evaluate import evaluate
        from imgest.tasks.evaluate.retrievers import dumps

        report = evaluate(config)
    except USER_ERRORS as exc:
        fail(exc)
    if as_json:
        typer.echo(dumps(report))
    else:
        from imgest.reports.evaluation import render_eval

        typer.echo(render_eval(report))


queries_app = typer.Typer(help="Build labelled query sets for evaluation.", no_args_is_help=True)
app.add_typer(queries_app, name="queries")


@queries_app.command("class")
def queries_class(
    catalogue: str = typer.Option(..., help="The catalogue root the store ingested (item ids are keys below it)"),
    out: str = typer.Option(..., help="Output JSONL (a .meta.json sidecar records the seed)"),
    prefix: str = typer.Option("", help="Only keys under this prefix; the label is each key's parent folder"),
    per_class: int = typer.Option(10, help="Queries drawn per class"),
    seed: int = typer.Option(0, help="Seed of the draw"),
) -> None:
    """A blind class-level set: held-out catalogue items as queries, their class as relevant, self excluded."""
    from imgest.retrieval.querysets import build_class_queries

    try:
        meta = build_class_queries(catalogue, out, per_class, seed, prefix)
    except USER_ERRORS as exc:
        fail(exc)
    typer.echo(f"{meta['queries']} class queries over {len(meta['classes'])} classes written to {out} (seed {seed})")


@queries_app.command("instance")
def queries_instance(
    catalogue: str = typer.Option(..., help="Catalogue"),
    out: str = typer.Option(..., help="Output folder: images/ and queries.jsonl"),
    prefix: str = typer.Option("", help="Only catalogue keys under this prefix become queries"),
    seed: int = typer.Option(0, help="Seed of the transforms"),
) -> None:
    """An instance-level set: crops, flips and colour changes of catalogue images, each finding its original."""
    from imgest.retrieval.querysets import build_instance_queries

    try:
        meta = build_instance_queries(catalogue, out, prefix, seed)
    except USER_ERRORS as exc:
        fail(exc)
    typer.echo(f"{meta['queries']} instance queries written to {meta['file']} (seed {seed})")


report_app = typer.Typer(help="Decision reports.", no_args_is_help=True)
app.add_typer(report_app, name="report")


@report_app.command("cost")
def report_cost(
    store: str = typer.Option(..., help="Folder or URL of the store"),
    corpus_size: int = typer.Option(..., help="N items to cost"),
    gpu_hour_price: Optional[float] = typer.Option(None, help="Price of one GPU-hour"),
    node_memory: str = typer.Option("64G", help="Memory of a serving node"),
    node_disk: str = typer.Option("unlimited", help="Local disk of a serving node for a PQ index's re-rank vectors"),
    device: str = typer.Option(DEFAULT_DEVICE, help="Where to measure encode throughput"),
    rehearsal: Optional[str] = typer.Option(None, help="A model change rehearsed at some N (the JSON "
                                            "bench/bench_model_change.py --json prints): its stages in hours at "
                                            "--corpus-size"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Encode throughput and hours, re-encode cost, query encode time, storage, index fit, dual-window storage;
    with --rehearsal, a model change's window in hours."""
    from imgest.reports.cost import cost_report, read_rehearsal
    from imgest.reports.index import render_cost

    try:
        rehearsed = read_rehearsal(rehearsal) if rehearsal else None
        report = cost_report(store, corpus_size, gpu_hour_price, node_memory, device, node_disk=node_disk,
                             rehearsal=rehearsed)
    except USER_ERRORS as exc:
        fail(exc)
    typer.echo(json.dumps(report, indent=2) if as_json else render_cost(report))
