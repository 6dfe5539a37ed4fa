"""Command: train-head (a metric-learning head on stored embeddings, saved as a model of its own)."""

from __future__ import annotations

import json

import typer

from imgest.cli import _fail, _user_errors, app


@app.command("train-head")
def train_head_cmd(
    store: str = typer.Option(..., help="Folder or URL of the store holding the base model's embeddings"),
    base_model: str = typer.Option("efficientnet-lite0", help="Base model: name, model id or slug in the store"),
    labels: str = typer.Option(None, help="CSV with header item_id,label (instance or class), or JSONL; without "
                                         "it, each item is its own label with augmented views as positives"),
    views: int = typer.Option(3, help="Without --labels: augmented views per catalogue image (encoded once)"),
    max_items: int = typer.Option(0, help="Without --labels: at most this many catalogue items (0: all)"),
    loss: str = typer.Option("infonce", help="triplet (semi-hard mining), infonce (NT-Xent) or proxynca"),
    dim: int = typer.Option(256, help="Output dimension of the head"),
    hidden: int = typer.Option(1024, help="Hidden width of the MLP"),
    epochs: int = typer.Option(50, help="Most epochs; early stopping on held-out recall@1 usually ends sooner"),
    labels_per_batch: int = typer.Option(32, help="P of the P x K batches"),
    items_per_label: int = typer.Option(4, help="K of the P x K batches (>= 2)"),
    lr: float = typer.Option(1e-3, help="AdamW learning rate (proxies: 10x)"),
    val_fraction: float = typer.Option(0.2, help="Share held out for validation and evaluation"),
    split: str = typer.Option("items", help="items: held-out items of every label; labels: held-out labels"),
    patience: int = typer.Option(5, help="Epochs without a better held-out recall@1 before stopping"),
    margin: float = typer.Option(0.2, help="Triplet margin (squared distance of unit vectors)"),
    temperature: float = typer.Option(0.1, help="InfoNCE temperature"),
    seed: int = typer.Option(0, help="Seed of the split, the batches and the initial weights"),
    as_json: bool = typer.Option(False, "--json", help="Print the training summary as JSON"),
) -> None:
    """Train a projection head with a metric loss on frozen base embeddings read from the shards."""
    from flows.train_head import render_head, train_head_flow
    from tasks.heads import HeadConfig, HeadError

    training = {"loss": loss, "dim_out": dim, "hidden": hidden, "epochs": epochs, "labels_per_batch": labels_per_batch,
                "items_per_label": items_per_label, "lr": lr, "val_fraction": val_fraction, "split": split,
                "patience": patience, "margin": margin, "temperature": temperature, "seed": seed}
    try:
        HeadConfig(**training).check()  # before Prefect starts: a bad parameter is one line, exit 2
        summary = train_head_flow(store=store, base_model=base_model, labels=labels, views=views, max_items=max_items,
                                  **training)
    except (HeadError, *_user_errors()) as exc:
        _fail(exc)
    if as_json:
        typer.echo(json.dumps(summary, indent=2, default=str))
    else:
        typer.echo(render_head(summary))
        typer.echo(f"use it like any model: imgest migrate start --store {store} --to {summary['head']}")
