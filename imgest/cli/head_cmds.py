"""Command: train-head (a metric-learning head on stored embeddings, saved as a model of its own)."""

from __future__ import annotations

import json

import typer

from imgest.cli import _fail, _user_errors, app
from imgest.defaults import DEFAULT_DEVICE, DEFAULT_MODEL, DEFAULT_VIEWS
from imgest.tasks.heads import HeadConfig

HEAD = HeadConfig()  # the training defaults, declared on HeadConfig


@app.command("train-head")
def train_head_cmd(
    store: str = typer.Option(..., help="Folder or URL of the store holding the base model's embeddings"),
    base_model: str = typer.Option(DEFAULT_MODEL, help="Base model: name, model id or slug in the store"),
    labels: str = typer.Option(None, help="CSV with header item_id,label (instance or class), or JSONL; without "
                                         "it, each item is its own label with augmented views as positives"),
    views: int = typer.Option(DEFAULT_VIEWS, help="Without --labels: augmented views per catalogue image "
                                                  "(encoded once)"),
    max_items: int = typer.Option(0, help="Without --labels: at most this many catalogue items (0: all)"),
    catalogue: str = typer.Option(None, help="The catalogue the base model was ingested from (checked against the "
                                             "one recorded at ingest); images are read only under it. Default: "
                                             "the recorded one, when it is on the store's kind of storage"),
    augment: str = typer.Option("all", help="Without --labels: the augmentations making the views: all, or a comma "
                                            "list of crop, flip, rotate, perspective, colour, contrast, background, "
                                            "quantise, edges, blur, jpeg, or of the groups geometry, photometry, "
                                            "rendering"),
    eval_queries: str = typer.Option(None, help="A labelled query set in `imgest eval`'s format (e.g. real query "
                                                "photos): epochs are selected on it and the report gives base vs "
                                                "head on it with a paired bootstrap interval"),
    loss: str = typer.Option(HEAD.loss, help="triplet (semi-hard mining), infonce (NT-Xent) or proxynca"),
    head_type: str = typer.Option(HEAD.head_type, help="residual (starts as the identity: the untrained head is the "
                                                       "base) or mlp (a new space of --dim dimensions)"),
    dim: int = typer.Option(HEAD.dim_out, help="Output dimension of an mlp head (0: the base model's)"),
    hidden: int = typer.Option(HEAD.hidden, help="Hidden width"),
    keep: float = typer.Option(HEAD.keep, help="Weight of the term keeping each item's base neighbourhood (0: off)"),
    hard_negatives: int = typer.Option(HEAD.hard_negatives, help="Base-space neighbour labels each label brings "
                                                                 "into its batch (0: random batches)"),
    epochs: int = typer.Option(HEAD.epochs, help="Most epochs; early stopping on held-out recall@1 usually ends "
                                                 "sooner"),
    labels_per_batch: int = typer.Option(HEAD.labels_per_batch, help="P of the P x K batches"),
    items_per_label: int = typer.Option(HEAD.items_per_label, help="K of the P x K batches (>= 2)"),
    lr: float = typer.Option(HEAD.lr, help="AdamW learning rate (proxies: 10x)"),
    val_fraction: float = typer.Option(HEAD.val_fraction, help="Share held out for validation and evaluation"),
    split: str = typer.Option(HEAD.split, help="items: held-out items of every label; labels: held-out labels"),
    patience: int = typer.Option(HEAD.patience, help="Epochs without a better held-out recall@1 before stopping"),
    margin: float = typer.Option(HEAD.margin, help="Triplet margin (squared distance of unit vectors)"),
    temperature: float = typer.Option(HEAD.temperature, help="InfoNCE temperature"),
    seed: int = typer.Option(HEAD.seed, help="Seed of the split, the batches and the initial weights"),
    device: str = typer.Option(DEFAULT_DEVICE, help="Where --eval-queries images are encoded: auto, cpu, cuda"),
    as_json: bool = typer.Option(False, "--json", help="Print the training summary as JSON"),
) -> None:
    """Train a projection head with a metric loss on frozen base embeddings read from the shards."""
    from imgest.config import TrainHeadConfig
    from imgest.flows.train_head import train_head_flow
    from imgest.tasks.markdown import render_head

    training = {"loss": loss, "head_type": head_type, "dim_out": dim, "hidden": hidden, "epochs": epochs,
                "labels_per_batch": labels_per_batch, "items_per_label": items_per_label, "lr": lr,
                "val_fraction": val_fraction, "split": split, "patience": patience, "margin": margin,
                "temperature": temperature, "keep": keep, "hard_negatives": hard_negatives, "seed": seed}
    try:
        # before Prefect starts: a bad parameter is one line, exit 2
        TrainHeadConfig(store=store, base_model=base_model, labels=labels, views=views, max_items=max_items,
                        augment=augment, eval_queries=eval_queries, catalogue=catalogue,
                        training=HeadConfig(**training))
        summary = train_head_flow(store=store, base_model=base_model, labels=labels, views=views, max_items=max_items,
                                  augment=augment, eval_queries=eval_queries, device=device, catalogue=catalogue,
                                  **training)
    except _user_errors() as exc:
        _fail(exc)
    if as_json:
        typer.echo(json.dumps(summary, indent=2, default=str))
    else:
        typer.echo(render_head(summary))
        typer.echo(f"use it like any model: imgest migrate start --store {store} --to {summary['head']}")
