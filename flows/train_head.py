"""Train an embedding head on a model's stored embeddings; save it as a model of its own (`head:<folder>`)."""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import asdict

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

import imgest
from flows.naming import run_name
from imgest.storage import Location, open_location, read_url
from tasks.export import find_model
from tasks.heads import HeadConfig, HeadError, augmented_instances, loss_curves_png, read_labels, train_head
from tasks.live import load_live_vectors
from tasks.plots import markdown_image
from tasks.state import now_iso


def heldout_queries(result, item_ids: list[str], uris: list[str], labels: list[str]) -> list[dict]:
    """The validation items as an `imgest eval` query set: every other item with the label is relevant."""
    by_label: dict[str, list[str]] = {}
    for item_id, label in zip(item_ids, labels):
        by_label.setdefault(label, []).append(item_id)
    uri_of, label_of = dict(zip(item_ids, uris)), dict(zip(item_ids, labels))
    return [{"query_id": q, "image": uri_of[q], "class": label_of[q], "exclude": [q],
             "relevant": [i for i in by_label[label_of[q]] if i != q]} for q in result.val_item_ids]


def save_head(store: Location, result, base: dict, source: dict, queries: list[dict],
              images: dict[str, bytes] | None = None) -> dict:
    from safetensors.torch import save as save_tensors

    weights = save_tensors({k: v.contiguous() for k, v in result.state_dict.items()})
    head_id = "head-" + hashlib.sha256(weights).hexdigest()[:12]
    folder = f"heads/{head_id}"
    cfg = result.config
    config = {
        "base_model": base["name"], "base_model_id": base["model_id"], "base_slug": base["slug"],
        "dim_in": result.dim_in, "hidden": cfg.hidden, "dim_out": cfg.dim_out, "architecture":
        "Linear(dim_in, hidden) -> GELU -> Linear(hidden, dim_out) -> L2 normalise",
        "loss": cfg.loss, "training": asdict(cfg), "labels": source,
        "counts": {"labels": result.labels, "train_items": result.train_items, "val_items": result.val_items},
        "validation": {"recall@1": result.val_recall_at_1, "base_recall@1": result.base_val_recall_at_1,
                       "best_epoch": result.best_epoch, "history": result.history},
        "weights_sha256": hashlib.sha256(weights).hexdigest(), "seconds": result.seconds,
        "created": now_iso(), "imgest_version": imgest.__version__,
    }
    store.write_bytes(f"{folder}/head.safetensors", weights)
    for key, data in (images or {}).items():  # augmented held-out views: query images of their own
        store.write_bytes(f"{folder}/{key}", data)
    queries = [q | {"image": store.uri(f"{folder}/{q['image']}")} if q["image"] in (images or {}) else q
               for q in queries]
    store.write_bytes(f"{folder}/heldout-queries.jsonl", "".join(json.dumps(q) + "\n" for q in queries).encode())
    store.write_bytes(f"{folder}/loss-curves.png", curves := loss_curves_png(result))
    store.write_json(f"{folder}/head.json", config)  # last: a folder without it is not a head
    return {"head": f"head:{store.uri(folder)}", "head_id": head_id, "folder": store.uri(folder),
            "queries": store.uri(f"{folder}/heldout-queries.jsonl"), "config": config, "loss_curves_png": curves}


@task(name="train-head", cache_policy=NO_CACHE)
def train_task(vectors, item_ids, labels, cfg: HeadConfig):
    logger = get_run_logger()
    return train_head(vectors, item_ids, labels, cfg, log=logger.info)


@flow(name="train-head", flow_run_name=run_name("train-head", "loss"), validate_parameters=True)
def train_head_flow(store: str, base_model: str, labels: str | None = None, loss: str = "infonce",
                    dim_out: int = 256, hidden: int = 1024, epochs: int = 50, labels_per_batch: int = 32,
                    items_per_label: int = 4, lr: float = 1e-3, val_fraction: float = 0.2, split: str = "items",
                    patience: int = 5, margin: float = 0.2, temperature: float = 0.1, seed: int = 0,
                    views: int = 3, max_items: int = 0) -> dict:
    """With `labels`: items and their labels. Without: each catalogue item is its own label, with `views`
    augmented views of its image (crop, mirror, colour) as positives; held-out items are unseen instances."""
    cfg = HeadConfig(loss=loss, dim_out=dim_out, hidden=hidden, epochs=epochs, labels_per_batch=labels_per_batch,
                     items_per_label=items_per_label, lr=lr, val_fraction=val_fraction,
                     split=split if labels else "labels", patience=patience, margin=margin,
                     temperature=temperature, seed=seed)
    cfg.check()
    store_loc = open_location(store, must_exist=True, what="store")
    base = find_model(store_loc, base_model)
    live = load_live_vectors(store_loc, base["slug"], int(base["dim"]))
    if labels:
        data = read_url(labels)
        by_item = read_labels(data, labels)
        keep = [n for n, item_id in enumerate(live.item_ids) if item_id in by_item]
        if not keep:
            raise HeadError(f"none of the {len(by_item)} labelled items is a live item of {base['model_id']} in "
                            f"{store}; item_id is the key relative to the catalogue root, as `imgest export` writes it")
        item_ids = [live.item_ids[n] for n in keep]
        label_list = [by_item[i] for i in item_ids]
        result = train_task(live.vectors[keep], item_ids, label_list, cfg)
        source = {"file": labels, "sha256": hashlib.sha256(data).hexdigest()}
        queries, images = heldout_queries(result, item_ids, [live.uris[n] for n in keep], label_list), {}
        counts = {"labelled_live_items": len(keep), "unlabelled_live_items": len(live) - len(keep),
                  "labels_not_in_store": len(set(by_item) - set(item_ids))}
    else:
        vectors, item_ids, label_list, used = augment_task(live, base["name"], views, seed, max_items)
        result = train_task(vectors, item_ids, label_list, cfg)
        source = {"file": None, "augmented_views": views, "items": len(used), "seed": seed,
                  "transforms": "crop 60-85%, mirror (p=0.5), brightness 0.7-1.3, colour 0.3-1.7"}
        queries, images = heldout_views(result, live, used, views, seed)
        counts = {"labelled_live_items": 0, "unlabelled_live_items": len(live), "labels_not_in_store": 0}
    saved = save_head(store_loc, result, base, source, queries, images)
    curves = saved.pop("loss_curves_png")
    summary = {**saved, **counts, "result": result.summary()}
    create_markdown_artifact(render_head(summary) + "\n" + markdown_image(curves, "loss curves"),
                             key="head-training", description=f"{loss} head on {base['model_id']}")
    return summary


@task(name="augment-and-encode", cache_policy=NO_CACHE)
def augment_task(live, base_name: str, views: int, seed: int, max_items: int):
    return augmented_instances(live, base_name, views, seed, max_items, log=get_run_logger().info)


def heldout_views(result, live, used: list[int], views: int, seed: int) -> tuple[list[dict], dict[str, bytes]]:
    """The held-out instances as an eval query set: their augmented views, regenerated from the same seeds
    as PNG files to keep beside the head, each with its original catalogue item as the one relevant."""
    from tasks.decode import decode_image
    from tasks.heads import augment, view_rng

    held = {i for i in result.val_item_ids if "#view" not in i}
    queries, images = [], {}
    for row in used:
        item_id = live.item_ids[row]
        if item_id not in held:
            continue
        image = decode_image(read_url(live.uris[row]))
        for v in range(views):
            buf = io.BytesIO()
            augment(image, view_rng(seed, row, v)).save(buf, "PNG")
            key = f"heldout/{hashlib.sha256(f'{item_id}#{v}'.encode()).hexdigest()[:16]}.png"
            images[key] = buf.getvalue()
            queries.append({"query_id": f"{item_id}#view{v}", "image": key, "relevant": [item_id]})
    return queries, images


def render_head(summary: dict) -> str:
    c, v = summary["config"], summary["config"]["validation"]
    return "\n".join([
        f"## Head `{summary['head_id']}` ({c['loss']}) on `{c['base_model_id']}`",
        "",
        f"- model name: `{summary['head']}`",
        f"- {c['counts']['train_items']} training and {c['counts']['val_items']} held-out items, "
        + (f"{c['counts']['labels']} labels; {summary['unlabelled_live_items']} live items had no label"
         if c["labels"]["file"] else f"no labels: {c['labels']['items']} catalogue items as instances, "
         f"{c['labels']['augmented_views']} augmented views each ({c['labels']['transforms']})"),
        f"- held-out recall@1: **{v['recall@1']}** with the head vs {v['base_recall@1']} with the base model "
        f"(best epoch {v['best_epoch']} of {len(v['history'])}); trained in {c['seconds']} s",
        f"- held-out query set for `imgest eval`: `{summary['queries']}`",
        "",
    ])
