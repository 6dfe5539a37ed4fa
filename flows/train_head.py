"""Train an embedding head on a model's stored embeddings; save it as a model of its own (`head:<folder>`)."""

from __future__ import annotations

import sys

from prefect.artifacts import create_markdown_artifact

from imgest.config import TrainHeadConfig
from imgest.config.flow_params import configured_flow
from imgest.names import SELF_SUPERVISED_ITEMS, parse_augmentations
from imgest.plots import markdown_image
from imgest.reports.heads import render_head, render_whitening
from imgest.reports.run_names import run_name
from imgest.state.live import load_live_sample
from imgest.state.models import default_model, find_model
from imgest.storage import open_location
from imgest.storage.probe import check_writable
from imgest.tasks.heads.evaluate import scorer_task
from imgest.tasks.heads.files import augment_task, heldout_set, labelled_task, save_head, train_task
from imgest.tasks.heads.train import HeadError
from imgest.tasks.heads.whiten import whiten_task


@configured_flow(name="train-head", flow_run_name=run_name("train-head", "loss"))
def train_head_flow(config: TrainHeadConfig) -> dict:
    """With `labels`: items and their labels. Without: each catalogue item is its own label, with `views`
    augmented views of its image as positives; held-out items are unseen instances (a proxy). With
    `eval_queries` (a labelled query set in `imgest eval`'s format), epochs are selected on it and the report
    gives base vs head on it with the paired bootstrap interval."""
    # without labels, held-out items are unseen instances: the split is by label (each item its own)
    training = config.training if config.labels else config.training.model_copy(update={"split": "labels"})
    store_loc = open_location(config.store, must_exist=True, what="store")
    check_writable(store_loc, "heads")  # the head is written after training: a read-only store is refused first
    base = find_model(store_loc, default_model(store_loc, config.base_model, flag="--base-model", base=True))
    if training.head_type == "whiten":  # no labels: the live vectors, and augmented views of some images
        if config.labels:
            raise HeadError("a whitening learns without labels: give no --labels")
        # the fit uses a sample of at most `sample` vectors (the pairs and the proxy are drawn among them)
        live = load_live_sample(store_loc, base["slug"], int(base["dim"]), training.sample, training.seed)
        live.catalogue = config.catalogue  # images are read only under it (or the root recorded at ingest)
        saved = whiten_task(store_loc, base, live, training, config.views, parse_augmentations(config.augment),
                            config.device)
        create_markdown_artifact(render_whitening(saved), key="head-training",
                                 description=f"whitening of {base['model_id']}")
        return saved
    training.out_dim(int(base["dim"]))  # a residual head of another dimension: refused before any work
    live = None
    if config.labels:  # the label file joined with the live set: only the labelled items' vectors are read (at most
        # max_items of them, a seeded sample)
        data = labelled_task(store_loc, base, config.labels, config.max_items or 0, training.seed)
    else:  # the items whose views are made, and only those, are read: a seeded sample of SELF_SUPERVISED_ITEMS
        # unless max_items says otherwise (0: every live item); the record says which (its `labels.max_items`)
        limit = SELF_SUPERVISED_ITEMS if config.max_items is None else config.max_items
        live = load_live_sample(store_loc, base["slug"], int(base["dim"]), limit or sys.maxsize, training.seed)
        live.catalogue = config.catalogue  # images are read only under it (or the root recorded at ingest)
        data = augment_task(live, base["name"], config.views, training.seed, limit,
                            parse_augmentations(config.augment), config.device)
    scorer = scorer_task(store_loc, base, config.eval_queries, data, config.negatives, training.seed,
                         config.device) if config.eval_queries else None
    result = train_task(data, training, scorer)
    evaluation = None
    if scorer is not None:
        from imgest.encoders.head import load_state, project

        evaluation = scorer.report(lambda v: project(load_state(result), v), seed=training.seed)
    data.drop_vectors()  # trained and scored: the held-out queries need only ids and labels from here on
    queries, views = heldout_set(result, data, live, config.views, training.seed)
    saved = save_head(store_loc, result, base, data.source, queries, views, evaluation)
    curves = saved.pop("loss_curves_png")
    summary = {**saved, **data.counts, "result": result.summary()}
    create_markdown_artifact(render_head(summary) + "\n" + markdown_image(curves, "loss curves"),
                             key="head-training", description=f"{training.loss} head on {base['model_id']}")
    return summary
