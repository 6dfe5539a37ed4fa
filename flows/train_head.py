"""Train an embedding head on a model's stored embeddings; save it as a model of its own (`head:<folder>`)."""

from __future__ import annotations

from dataclasses import replace

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from imgest.config import HEAD, TrainHeadConfig
from imgest.defaults import DEFAULT_MODEL, DEFAULT_VIEWS
from imgest.storage import open_location
from imgest.tasks.head_files import augment_task, heldout_set, labelled_set, save_head, train_task
from imgest.tasks.live import load_live_vectors
from imgest.tasks.markdown import render_head
from imgest.tasks.models import find_model
from imgest.tasks.plots import markdown_image
from imgest.tasks.run_names import run_name


@flow(name="train-head", flow_run_name=run_name("train-head", "loss"), validate_parameters=True)
def train_head_flow(store: str, base_model: str = DEFAULT_MODEL, labels: str | None = None, loss: str = HEAD.loss,
                    dim_out: int = HEAD.dim_out, hidden: int = HEAD.hidden, epochs: int = HEAD.epochs,
                    labels_per_batch: int = HEAD.labels_per_batch, items_per_label: int = HEAD.items_per_label,
                    lr: float = HEAD.lr, val_fraction: float = HEAD.val_fraction, split: str = HEAD.split,
                    patience: int = HEAD.patience, margin: float = HEAD.margin,
                    temperature: float = HEAD.temperature, seed: int = HEAD.seed, views: int = DEFAULT_VIEWS,
                    max_items: int = 0) -> dict:
    """With `labels`: items and their labels. Without: each catalogue item is its own label, with `views`
    augmented views of its image (crop, mirror, colour) as positives; held-out items are unseen instances."""
    training = replace(HEAD, loss=loss, dim_out=dim_out, hidden=hidden, epochs=epochs,
                       labels_per_batch=labels_per_batch, items_per_label=items_per_label, lr=lr,
                       val_fraction=val_fraction, split=split if labels else "labels", patience=patience,
                       margin=margin, temperature=temperature, seed=seed)
    cfg = TrainHeadConfig(store=store, base_model=base_model, labels=labels, views=views, max_items=max_items,
                          training=training)
    store_loc = open_location(cfg.store, must_exist=True, what="store")
    base = find_model(store_loc, cfg.base_model)
    live = load_live_vectors(store_loc, base["slug"], int(base["dim"]))
    if cfg.labels:
        data = labelled_set(live, cfg.labels, base["model_id"])
    else:
        data = augment_task(live, base["name"], cfg.views, training.seed, cfg.max_items)
    result = train_task(data, training)
    queries, views = heldout_set(result, data, live, cfg.views, training.seed)
    saved = save_head(store_loc, result, base, data.source, queries, views)
    curves = saved.pop("loss_curves_png")
    summary = {**saved, **data.counts, "result": result.summary()}
    create_markdown_artifact(render_head(summary) + "\n" + markdown_image(curves, "loss curves"),
                             key="head-training", description=f"{training.loss} head on {base['model_id']}")
    return summary
