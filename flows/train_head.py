"""Train an embedding head on a model's stored embeddings; save it as a model of its own (`head:<folder>`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

import imgest
from flows.naming import run_name
from imgest.storage import Location, open_location, read_url
from tasks.export import find_model
from tasks.heads import HeadConfig, HeadError, loss_curves_png, read_labels, train_head
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


def save_head(store: Location, result, base: dict, labels_sha256: str, labels_name: str, queries: list[dict]) -> dict:
    from safetensors.torch import save as save_tensors

    weights = save_tensors({k: v.contiguous() for k, v in result.state_dict.items()})
    head_id = "head-" + hashlib.sha256(weights).hexdigest()[:12]
    folder = f"heads/{head_id}"
    cfg = result.config
    config = {
        "base_model": base["name"], "base_model_id": base["model_id"], "base_slug": base["slug"],
        "dim_in": result.dim_in, "hidden": cfg.hidden, "dim_out": cfg.dim_out, "architecture":
        "Linear(dim_in, hidden) -> GELU -> Linear(hidden, dim_out) -> L2 normalise",
        "loss": cfg.loss, "training": asdict(cfg), "labels": {"file": labels_name, "sha256": labels_sha256},
        "counts": {"labels": result.labels, "train_items": result.train_items, "val_items": result.val_items},
        "validation": {"recall@1": result.val_recall_at_1, "base_recall@1": result.base_val_recall_at_1,
                       "best_epoch": result.best_epoch, "history": result.history},
        "weights_sha256": hashlib.sha256(weights).hexdigest(), "seconds": result.seconds,
        "created": now_iso(), "imgest_version": imgest.__version__,
    }
    store.write_bytes(f"{folder}/head.safetensors", weights)
    store.write_bytes(f"{folder}/heldout-queries.jsonl", "".join(json.dumps(q) + "\n" for q in queries).encode())
    store.write_bytes(f"{folder}/loss-curves.png", loss_curves_png(result))
    store.write_json(f"{folder}/head.json", config)  # last: a folder without it is not a head
    return {"head": f"head:{store.uri(folder)}", "head_id": head_id, "folder": store.uri(folder),
            "queries": store.uri(f"{folder}/heldout-queries.jsonl"), "config": config}


@task(name="train-head", cache_policy=NO_CACHE)
def train_task(vectors, item_ids, labels, cfg: HeadConfig):
    logger = get_run_logger()
    return train_head(vectors, item_ids, labels, cfg, log=logger.info)


@flow(name="train-head", flow_run_name=run_name("train-head", "loss"), validate_parameters=True)
def train_head_flow(store: str, base_model: str, labels: str, loss: str = "infonce", dim_out: int = 256,
                    hidden: int = 1024, epochs: int = 50, labels_per_batch: int = 32, items_per_label: int = 4,
                    lr: float = 1e-3, val_fraction: float = 0.2, split: str = "items", patience: int = 5,
                    margin: float = 0.2, temperature: float = 0.1, seed: int = 0) -> dict:
    cfg = HeadConfig(loss=loss, dim_out=dim_out, hidden=hidden, epochs=epochs, labels_per_batch=labels_per_batch,
                     items_per_label=items_per_label, lr=lr, val_fraction=val_fraction, split=split,
                     patience=patience, margin=margin, temperature=temperature, seed=seed)
    cfg.check()
    store_loc = open_location(store, must_exist=True, what="store")
    base = find_model(store_loc, base_model)
    data = read_url(labels)
    by_item = read_labels(data, labels)
    live = load_live_vectors(store_loc, base["slug"], int(base["dim"]))
    keep = [n for n, item_id in enumerate(live.item_ids) if item_id in by_item]
    if not keep:
        raise HeadError(f"none of the {len(by_item)} labelled items is a live item of {base['model_id']} in {store}; "
                        "item_id is the key relative to the catalogue root, as `imgest export` writes it")
    item_ids = [live.item_ids[n] for n in keep]
    uris = [live.uris[n] for n in keep]
    label_list = [by_item[i] for i in item_ids]
    result = train_task(live.vectors[keep], item_ids, label_list, cfg)
    saved = save_head(store_loc, result, base, hashlib.sha256(data).hexdigest(), labels,
                      heldout_queries(result, item_ids, uris, label_list))
    unlabelled = len(live) - len(keep)
    summary = {**saved, "labelled_live_items": len(keep), "unlabelled_live_items": unlabelled,
               "labels_not_in_store": len(set(by_item) - set(item_ids)), "result": result.summary()}
    create_markdown_artifact(render_head(summary) + "\n" + markdown_image(loss_curves_png(result), "loss curves"),
                             key="head-training", description=f"{loss} head on {base['model_id']}")
    return summary


def render_head(summary: dict) -> str:
    c, v = summary["config"], summary["config"]["validation"]
    return "\n".join([
        f"## Head `{summary['head_id']}` ({c['loss']}) on `{c['base_model_id']}`",
        "",
        f"- model name: `{summary['head']}`",
        f"- {c['counts']['train_items']} training and {c['counts']['val_items']} held-out items, "
        f"{c['counts']['labels']} labels; {summary['unlabelled_live_items']} live items had no label",
        f"- held-out recall@1: **{v['recall@1']}** with the head vs {v['base_recall@1']} with the base model "
        f"(best epoch {v['best_epoch']} of {len(v['history'])}); trained in {c['seconds']} s",
        f"- held-out query set for `imgest eval`: `{summary['queries']}`",
        "",
    ])
