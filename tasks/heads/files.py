"""A head's training set (labelled live items, or augmented views of each item), the training tasks, and
what the head is saved with: its record (head.json), its held-out query set and loss curves."""

from __future__ import annotations

import hashlib
import io
import logging
from dataclasses import dataclass, field

import numpy as np
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from imgest.config import HeadConfig
from imgest.encoders.head import ARCHITECTURES, HELDOUT_VIEWS, serialise_weights, write_head
from imgest.images.decode import DecodeError, decode_image
from imgest.names import VERSION
from imgest.state.clock import now_iso
from imgest.state.live import LiveVectors
from imgest.storage import Location, StorageError, read_url
from imgest.tasks.heads.train import HeadError, loss_curves_png, read_labels, train_head
from imgest.tasks.heads.views import DESCRIPTION, augment, augmented_instances, view_rng


@dataclass
class TrainingSet:
    """What a head trains on: vectors with their item ids and labels, where they came from, and counts."""

    vectors: np.ndarray
    item_ids: list[str]
    labels: list[str]
    source: dict  # head.json's `labels`: the labels file and its sha256, or the augmentation
    counts: dict
    uris: list[str] = field(default_factory=list)  # labelled: each item's image (held-out queries)
    rows: list[int] = field(default_factory=list)  # augmented: the live rows whose views were made


def labelled_set(live: LiveVectors, labels_url: str, model_id: str) -> TrainingSet:
    """The live items that have a label in `labels_url` (CSV `item_id,label` or JSONL)."""
    data = read_url(labels_url)
    by_item = read_labels(data, labels_url)
    keep = [n for n, item_id in enumerate(live.item_ids) if item_id in by_item]
    if not keep:
        raise HeadError(f"none of the {len(by_item)} labelled items is a live item of {model_id}; item_id is the "
                        "key relative to the catalogue root, as `imgest export` writes it")
    item_ids = [live.item_ids[n] for n in keep]
    return TrainingSet(
        vectors=live.vectors[keep], item_ids=item_ids, labels=[by_item[i] for i in item_ids],
        source={"file": labels_url, "sha256": hashlib.sha256(data).hexdigest()},
        counts={"labelled_live_items": len(keep), "unlabelled_live_items": len(live) - len(keep),
                "labels_not_in_store": len(set(by_item) - set(item_ids))},
        uris=[live.uris[n] for n in keep])


@task(name="augment-and-encode", cache_policy=NO_CACHE)
def augment_task(live: LiveVectors, base_name: str, views: int, seed: int, max_items: int,
                 names: tuple[str, ...]) -> TrainingSet:
    """No labels: each catalogue item is its own label, with `views` augmented views as its positives."""
    vectors, item_ids, labels, rows = augmented_instances(live, base_name, views, seed, max_items,
                                                          names=names, log=get_run_logger().info)
    return TrainingSet(
        vectors=vectors, item_ids=item_ids, labels=labels,
        source={"file": None, "augmented_views": views, "items": len(rows), "seed": seed,
                "augmentations": list(names), "transforms": DESCRIPTION},
        counts={"labelled_live_items": 0, "unlabelled_live_items": len(live), "labels_not_in_store": 0},
        rows=rows)


@task(name="train-head", cache_policy=NO_CACHE)
def train_task(training: TrainingSet, cfg: HeadConfig, scorer=None):
    return train_head(training.vectors, training.item_ids, training.labels, cfg, log=get_run_logger().info,
                      scorer=scorer)


PROXY = ("a proxy: the queries are views made by the same augmentations the head trained on, so a gain here "
         "does not show robustness to a shift the augmentations do not cover (another camera, artist, style or "
         "background); evaluate on real queries (--eval-queries, or `imgest eval` in a migration window) before "
         "promoting")


def validation_record(result, source: dict, evaluation: dict | None) -> dict:
    """What the training's validation measured, in words, whether it is a proxy, and its figures."""
    cfg = result.config
    if evaluation:
        measured = (f"the given query set {evaluation['file']} ({evaluation['queries']} queries, sha256 "
                    f"{evaluation['sha256'][:12]}...): epochs were selected on it")
        note = ("epochs were selected on this set, so its figures are optimistic for it; confirm on another "
                "labelled set with `imgest eval`")
    elif source["file"] is None:
        measured = "held-out catalogue items, each queried by views made by the training augmentations"
        note = PROXY
    else:
        measured = ("held-out labels (classes unseen in training)" if cfg.split == "labels" else
                    "held-out items of the labels trained on") + ", queried against every labelled item"
        note = ("queries and gallery are the same catalogue's images: this does not show robustness to a shift "
                "between query photos and catalogue photos")
    return {"measured_on": measured, "proxy": not evaluation and source["file"] is None, "note": note,
            "selected_on": "eval queries recall@1 (then recall@10)" if evaluation else "held-out recall@1",
            "recall@1": result.val_recall_at_1, "base_recall@1": result.base_val_recall_at_1,
            "best_epoch": result.best_epoch, "history": result.history, "eval": evaluation}


def heldout_set(result, training: TrainingSet, live: LiveVectors, views: int,
                seed: int) -> tuple[list[dict], dict[str, bytes]]:
    """The held-out items as an `imgest eval` query set (and, for augmented training, their view images)."""
    if training.source["file"]:
        return heldout_queries(result, training.item_ids, training.uris, training.labels), {}
    return heldout_views(result, live, training.rows, views, seed, tuple(training.source["augmentations"]))


def heldout_queries(result, item_ids: list[str], uris: list[str], labels: list[str]) -> list[dict]:
    """The validation items as an `imgest eval` query set: every other item with the label is relevant."""
    by_label: dict[str, list[str]] = {}
    for item_id, label in zip(item_ids, labels):
        by_label.setdefault(label, []).append(item_id)
    uri_of, label_of = dict(zip(item_ids, uris)), dict(zip(item_ids, labels))
    return [{"query_id": q, "image": uri_of[q], "class": label_of[q], "exclude": [q],
             "relevant": [i for i in by_label[label_of[q]] if i != q]} for q in result.val_item_ids]


def head_record(result, base: dict, source: dict, weights_sha256: str, evaluation: dict | None = None) -> dict:
    """head.json: the base model it applies to, the architecture, how it was trained and validated."""
    cfg = result.config
    return {
        "base_model": base["name"], "base_model_id": base["model_id"], "base_slug": base["slug"],
        "dim_in": result.dim_in, "hidden": cfg.hidden, "dim_out": cfg.out_dim(result.dim_in),
        "head_type": cfg.head_type, "architecture": ARCHITECTURES[cfg.head_type],
        "loss": cfg.loss, "training": cfg.model_dump(), "labels": source,
        "counts": {"labels": result.labels, "train_items": result.train_items, "val_items": result.val_items},
        "validation": validation_record(result, source, evaluation),
        "weights_sha256": weights_sha256, "seconds": result.seconds,
        "created": now_iso(), "imgest_version": VERSION,
    }


def save_head(store: Location, result, base: dict, source: dict, queries: list[dict],
              views: dict[str, bytes] | None = None, evaluation: dict | None = None) -> dict:
    """The trained head as a model of its own (`head:<folder>`), with its record, query set and loss curves."""
    weights = serialise_weights(result.state_dict)
    config = head_record(result, base, source, hashlib.sha256(weights).hexdigest(), evaluation)
    curves = loss_curves_png(result)
    saved = write_head(store, weights, config, queries, views or {}, curves)
    return {**saved, "config": config, "loss_curves_png": curves}


def heldout_views(result, live, used: list[int], views: int, seed: int,
                  names: tuple[str, ...]) -> tuple[list[dict], dict[str, bytes]]:
    """The held-out instances as an eval query set: their augmented views, regenerated from the same seeds
    as PNG files to keep beside the head, each with its original catalogue item as the one relevant."""
    held = {i for i in result.val_item_ids if "#view" not in i}
    queries, images = [], {}
    for row in used:
        item_id = live.item_ids[row]
        if item_id not in held:
            continue
        try:
            image = decode_image(live.read_image(row))
        except (DecodeError, OSError, StorageError) as exc:  # one image's fault: that query is left out
            logging.getLogger("imgest").warning("held-out view of %s not made: %s", item_id, exc)
            continue
        for v in range(views):
            buf = io.BytesIO()
            augment(image, view_rng(seed, row, v), names).save(buf, "PNG")
            key = f"{HELDOUT_VIEWS}/{hashlib.sha256(f'{item_id}#{v}'.encode()).hexdigest()[:16]}.png"
            images[key] = buf.getvalue()
            queries.append({"query_id": f"{item_id}#view{v}", "image": key, "relevant": [item_id]})
    return queries, images
