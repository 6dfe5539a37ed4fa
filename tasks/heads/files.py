"""A head's training set (the labelled live items, read by joining the label file with the live set; or augmented
views of a sample of items), the training tasks, and what the head is saved with: its record (head.json), its
held-out query set and loss curves."""

from __future__ import annotations

import hashlib
import io
import logging
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from imgest.config import HeadConfig
from imgest.encoders.head import ARCHITECTURES, HELDOUT_VIEWS, serialise_weights, write_head
from imgest.images.decode import DecodeError, decode_image
from imgest.names import VERSION
from imgest.state.clock import now_iso
from imgest.state.committed import LIVE, load_state
from imgest.state.live import LiveVectors, live_count_of, live_rows_of, read_rows_vectors
from imgest.storage import Location, StorageError
from imgest.tasks.heads.labels import stage_labels
from imgest.tasks.heads.train import HeadError, as_strings, loss_curves_png, train_head
from imgest.tasks.heads.views import DESCRIPTION, ViewProgress, augment, augmented_instances, view_rng


@dataclass
class TrainingSet:
    """What a head trains on: vectors with their item ids and labels (Arrow arrays, or lists for the few rows of
    augmented views), where they came from, and counts."""

    vectors: np.ndarray
    item_ids: pa.Array | list[str]
    labels: pa.Array | list[str]
    source: dict  # head.json's `labels`: the labels file and its sha256, or the augmentation
    counts: dict
    uris_of: Callable[[pa.Array], dict[str, str]] | None = None  # labelled: the images of some items (held-out queries)
    rows: list[int] = field(default_factory=list)  # augmented: the live rows whose views were made
    encoded_by: dict[str, int] = field(default_factory=dict)  # the rows read, per what encoded them

    def drop_vectors(self) -> None:
        """Let the vectors go (the labelled set's are the largest thing a training holds)."""
        self.vectors = np.empty((0, self.vectors.shape[1]), np.float32)

    def originals(self) -> tuple[pa.Array, np.ndarray]:
        """The catalogue items among the rows (not their augmented views) and their stored vectors."""
        n = len(self.rows) if self.source["file"] is None else len(self.vectors)
        return as_strings(self.item_ids)[:n], self.vectors[:n]


@task(name="read-labelled", cache_policy=NO_CACHE)
def labelled_task(store: Location, base: dict, labels_url: str, max_items: int = 0, seed: int = 0) -> TrainingSet:
    return labelled_set(store, base, labels_url, max_items, seed)


def labelled_set(store: Location, base: dict, labels_url: str, max_items: int = 0, seed: int = 0) -> TrainingSet:
    """The live items that have a label in `labels_url` (CSV `item_id,label` or JSONL): the file streamed to Parquet
    on local disk (`stage_labels`), joined with the live set in the state's database, the labelled items' vectors
    read from the shards that hold them. With `max_items`, at most that many labelled items (a seeded sample, drawn
    in the join). Only what training needs is held per item (its id, label and vector); the images of the few held
    out as queries are looked up after training, and of the unlabelled items only their count is read."""
    with tempfile.TemporaryDirectory(prefix="imgest-labels-") as scratch:
        staged = stage_labels(labels_url, scratch)
        state = load_state(store, base["slug"])
        try:
            labelled, labelled_live = live_count_of(state, staged.relation())
            rows = live_rows_of(state, staged.relation(), "s.item_id, s.shard", max_items, seed)
            live = state.count(LIVE)
        finally:
            state.close()
    encoded_by: Counter = Counter()
    rows, vectors = read_rows_vectors(store, base["slug"], int(base["dim"]), rows, encoded_by)
    pa.default_memory_pool().release_unused()  # the shards' buffers back before training takes its share
    if not len(rows):
        raise HeadError(f"none of the {labelled} labelled items is a live item of {base['model_id']}; item_id is "
                        "the key relative to the catalogue root, as `imgest export` writes it")
    return TrainingSet(
        vectors=vectors, item_ids=rows["item_id"].combine_chunks(), labels=rows["label"].combine_chunks(),
        source={"file": labels_url, "sha256": staged.sha256},
        counts={"labelled_live_items": labelled_live, "unlabelled_live_items": live - labelled_live,
                "labels_not_in_store": labelled - labelled_live, "labelled_items_read": len(rows)},
        uris_of=lambda ids: live_uris(store, base["slug"], ids), encoded_by=dict(encoded_by))


def live_uris(store: Location, slug: str, item_ids: pa.Array) -> dict[str, str]:
    """The images of a few live items (the held-out queries), found by a join in the state."""
    state = load_state(store, slug)
    try:
        found = live_rows_of(state, pa.table({"item_id": as_strings(item_ids)}), "s.item_id, s.uri")
    finally:
        state.close()
    return dict(zip(found["item_id"].to_pylist(), found["uri"].to_pylist()))


@task(name="augment-and-encode", cache_policy=NO_CACHE)
def augment_task(live: LiveVectors, base_name: str, views: int, seed: int, max_items: int,
                 names: tuple[str, ...], device: str = "auto") -> TrainingSet:
    """No labels: each catalogue item is its own label, with `views` augmented views as its positives."""
    vectors, item_ids, labels, rows = augmented_instances(live, base_name, views, seed, max_items, device,
                                                          names=names, log=get_run_logger().info,
                                                          progress=ViewProgress(f"{base_name} views"))
    return TrainingSet(
        vectors=vectors, item_ids=item_ids, labels=labels,
        source={"file": None, "augmented_views": views, "items": len(rows), "max_items": max_items, "seed": seed,
                "augmentations": list(names), "transforms": DESCRIPTION},
        counts={"labelled_live_items": 0, "unlabelled_live_items": live.total or len(live), "labels_not_in_store": 0},
        rows=rows, encoded_by=dict(live.encoded_by or {}))


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


HELDOUT_QUERIES = 1000  # held-out items written as the head's query set, at most (a seeded sample of those measured)


def heldout_set(result, training: TrainingSet, live: LiveVectors | None, views: int,
                seed: int) -> tuple[Iterable[dict], dict[str, bytes]]:
    """The held-out items as an `imgest eval` query set (and, for augmented training, their view images)."""
    if training.source["file"]:
        return heldout_queries(result, training.item_ids, training.labels, training.uris_of, seed), {}
    return heldout_views(result, live, training.rows, views, seed, tuple(training.source["augmentations"]))


def heldout_queries(result, item_ids, labels, uris_of: Callable[[pa.Array], dict[str, str]],
                    seed: int = 0) -> Iterator[dict]:
    """Validation items as an `imgest eval` query set (HELDOUT_QUERIES of them at most), a label's queries at a
    time: every other item with the label is relevant. The items of the queries' labels are grouped as Arrow lists
    and become objects one label at a time; only the queries' images are looked up (`uris_of`)."""
    wanted = result.val_item_ids
    if len(wanted) > HELDOUT_QUERIES:
        picked = np.random.default_rng([seed, 2]).choice(len(wanted), HELDOUT_QUERIES, replace=False)
        wanted = [wanted[i] for i in np.sort(picked)]
    table = pa.table({"item_id": as_strings(item_ids), "label": as_strings(labels)})
    asked = table.filter(pc.is_in(table["item_id"], value_set=pa.array(wanted, pa.string())))
    asked_by_label: dict[str, list[str]] = {}
    for item_id, label in zip(asked["item_id"].to_pylist(), asked["label"].to_pylist()):
        asked_by_label.setdefault(label, []).append(item_id)
    grouped = table.filter(pc.is_in(table["label"], value_set=pc.unique(asked["label"]))) \
        .group_by("label", use_threads=False).aggregate([("item_id", "list")])
    del table, asked
    uri_of = uris_of(pa.array(wanted, pa.string()))
    for label, members in zip(grouped["label"].to_pylist(), grouped["item_id_list"]):
        items = members.values.to_pylist()
        for q in asked_by_label[label]:
            if q in uri_of:
                yield {"query_id": q, "image": uri_of[q], "class": label, "exclude": [q],
                       "relevant": [i for i in items if i != q]}


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


def save_head(store: Location, result, base: dict, source: dict, queries: Iterable[dict],
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
    held = sorted({i for i in result.val_item_ids if "#view" not in i})
    if len(held) > HELDOUT_QUERIES:
        held = [held[i] for i in np.sort(np.random.default_rng([seed, 2]).choice(len(held), HELDOUT_QUERIES,
                                                                                 replace=False))]
    held = set(held)
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
