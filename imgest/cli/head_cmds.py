"""Command: train-head (a metric-learning head on stored embeddings, saved as a model of its own)."""

from __future__ import annotations

import json

import typer

from imgest.cli.app import app, fail
from imgest.cli.options import config_command
from imgest.config import TrainHeadConfig
from imgest.errors import USER_ERRORS


@app.command("train-head")
@config_command(TrainHeadConfig)
def train_head_cmd(
    config: TrainHeadConfig,
    whiten: bool = typer.Option(False, "--whiten", help="Fit a learned whitening of the base model's vectors "
                                                          "instead (no labels; --dim, --shrinkage, --sample)"),
    as_json: bool = typer.Option(False, "--json", help="Print the training summary as JSON"),
) -> None:
    """Train a projection head with a metric loss on frozen base embeddings read from the shards, or fit a
    learned whitening of them (--whiten)."""
    from imgest.flows.train_head import train_head_flow
    from imgest.reports.heads import render_head, render_whitening

    if whiten:  # the same as --head-type whiten
        config = config.model_copy(update={"training": config.training.model_copy(update={"head_type": "whiten"})})
    try:
        from imgest.state.models import default_model, find_model
        from imgest.storage import open_location

        store = open_location(config.store, must_exist=True, what="store")  # before Prefect starts: one line
        config = config.model_copy(update={"base_model": default_model(store, config.base_model,
                                                                       flag="--base-model", base=True)})
        find_model(store, config.base_model)
        summary = train_head_flow(config)
    except USER_ERRORS as exc:
        fail(exc)
    if as_json:
        typer.echo(json.dumps(summary, indent=2, default=str))
    else:
        typer.echo(render_whitening(summary) if summary["config"]["head_type"] == "whiten" else render_head(summary))
        typer.echo(f"use it like any model: imgest migrate start --store {config.store} --to {summary['head']}")
