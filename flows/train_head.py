"""Train an embedding head on a model's stored embeddings; save it as a model of its own (`head:<folder>`)."""

from __future__ import annotations

from dataclasses import replace

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from imgest.config import HEAD, TrainHeadConfig
from imgest.defaults import DEFAULT_DEVICE, DEFAULT_MODEL, DEFAULT_VIEWS
from imgest.storage import open_location
from imgest.tasks.head_eval import query_scorer
from imgest.tasks.head_files import augment_task, heldout_set, labelled_set, save_head, train_task
from imgest.tasks.head_views import parse_augmentations
from imgest.tasks.live import load_live_vectors
from imgest.tasks.markdown import render_head
from imgest.tasks.models import find_model
from imgest.tasks.plots import markdown_image
from imgest.tasks.run_names import run_name


@flow(name="train-head", flow_run_name=run_name("train-head", "loss"), validate_parameters=True)
def train_head_flow(store: str, base_model: str = DEFAULT_MODEL, labels: str | None = None, loss: str = HEAD.loss,
                    head_type: str = HEAD.head_type, dim_out: int = HEAD.dim_out, hidden: int = HEAD.hidden,
                    epochs: int = HEAD.epochs, labels_per_batch: int = HEAD.labels_per_batch,
                    items_per_label: int = HEAD.items_per_label, lr: float = HEAD.lr,
                    val_fraction: float = HEAD.val_fraction, split: str = HEAD.split, patience: int = HEAD.patience,
                    margin: float = HEAD.margin, temperature: float = HEAD.temperature, keep: float = HEAD.keep,
                    hard_negatives: int = HEAD.hard_negatives, seed: int = HEAD.seed, views: int = DEFAULT_VIEWS,
                    max_items: int = 0, augment: str = "all", eval_queries: str | None = None,
                    device: str = DEFAULT_DEVICE, catalogue: str | None = None) -> dict:
    """With `labels`: items and their labels. Without: each catalogue item is its own label, with `views`
    augmented views of its image as positives; held-out items are unseen instances (a proxy). With
    `eval_queries` (a labelled query set in `imgest eval`'s format), epochs are selected on it and the report
    gives base vs head on it with the paired bootstrap interval."""
    training = replace(HEAD, loss=loss, head_type=head_type, dim_out=dim_out, hidden=hidden, epochs=epochs,
                       labels_per_batch=labels_per_batch, items_per_label=items_per_label, lr=lr,
                       val_fraction=val_fraction, split=split if labels else "labels", patience=patience,
                       margin=margin, temperature=temperature, keep=keep, hard_negatives=hard_negatives, seed=seed)
    cfg = TrainHeadConfig(store=store, base_model=base_model, labels=labels, views=views, max_items=max_items,
                          augment=augment, eval_queries=eval_queries, catalogue=catalogue, training=training)
    store_loc = open_location(cfg.store, must_exist=True, what="store")
    base = find_model(store_loc, cfg.base_model)
    training.out_dim(int(base["dim"]))  # a residual head of another dimension: refused before any work
    live = load_live_vectors(store_loc, base["slug"], int(base["dim"]))
    live.catalogue = cfg.catalogue  # images are read only under it (or the root recorded at ingest)
    if cfg.labels:
        data = labelled_set(live, cfg.labels, base["model_id"])
    else:
        data = augment_task(live, base["name"], cfg.views, training.seed, cfg.max_items,
                            parse_augmentations(cfg.augment))
    scorer = query_scorer(cfg.eval_queries, live, base["name"], device, get_run_logger().info) \
        if cfg.eval_queries else None
    result = train_task(data, training, scorer)
    evaluation = None
    if scorer is not None:
        from imgest.encoders.head import load_state, project

        evaluation = scorer.report(lambda v: project(load_state(result), v), seed=training.seed)
    queries, views = heldout_set(result, data, live, cfg.views, training.seed)
    saved = save_head(store_loc, result, base, data.source, queries, views, evaluation)
    curves = saved.pop("loss_curves_png")
    summary = {**saved, **data.counts, "result": result.summary()}
    create_markdown_artifact(render_head(summary) + "\n" + markdown_image(curves, "loss curves"),
                             key="head-training", description=f"{training.loss} head on {base['model_id']}")
    return summary
