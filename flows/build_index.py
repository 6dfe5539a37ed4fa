"""Build a versioned FAISS index of one model's live embeddings, tune it to a recall, move an alias."""

from __future__ import annotations

import os
import socket

import faiss
from prefect import flow, tags
from prefect.artifacts import create_markdown_artifact

import imgest
from imgest.config import IndexConfig
from imgest.defaults import (
    DEFAULT_ALIAS,
    DEFAULT_DISK,
    DEFAULT_INDEX_PARTS,
    DEFAULT_K,
    DEFAULT_KIND,
    DEFAULT_MEMORY,
    DEFAULT_MODEL,
    DEFAULT_RECALL_QUERIES,
    DEFAULT_RETRAIN_SHARE,
    DEFAULT_RUNNER,
    DEFAULT_TARGET_RECALL,
    DEFAULT_WORKERS,
)
from imgest.lock import StoreLock
from imgest.storage import open_location
from imgest.tasks.index_tasks import (
    build_key,
    build_version,
    record_build,
    reusable_version,
    verify_and_alias_task,
)
from imgest.tasks.live import live_fingerprint
from imgest.tasks.markdown import render_card
from imgest.tasks.models import find_model
from imgest.tasks.plots import markdown_image, recall_sweep_png
from imgest.tasks.run_names import run_name


@flow(name="build-index", flow_run_name=run_name("build-index"), validate_parameters=True)
def build_index(store: str, model: str = DEFAULT_MODEL, kind: str = DEFAULT_KIND, memory: str = DEFAULT_MEMORY,
                target_recall: float = DEFAULT_TARGET_RECALL, k: int = DEFAULT_K,
                queries: int = DEFAULT_RECALL_QUERIES, alias: str | None = DEFAULT_ALIAS,
                parts: int = DEFAULT_INDEX_PARTS, runner: str = DEFAULT_RUNNER, workers: int = DEFAULT_WORKERS,
                rebuild: bool = False, retrain_share: float = DEFAULT_RETRAIN_SHARE,
                disk: str = DEFAULT_DISK) -> dict:
    cfg = IndexConfig(store=store, model=model, kind=kind, memory=memory, target_recall=target_recall, k=k,
                      queries=queries, alias=alias, parts=parts, runner=runner, workers=workers, rebuild=rebuild,
                      retrain_share=retrain_share, disk=disk)
    store_loc = open_location(cfg.store, must_exist=True, what="store")
    card_model = find_model(store_loc, cfg.model)
    with tags(f"model:{card_model['slug']}"), \
            StoreLock(store_loc, owner=f"build-index@{socket.gethostname()}:{os.getpid()}") as lock:
        inputs = {"model_id": card_model["model_id"], "live_state": live_fingerprint(store_loc, card_model["slug"]),
                  "kind": cfg.kind, "memory": cfg.memory, "disk": cfg.disk, "target_recall": cfg.target_recall,
                  "k": cfg.k,
                  "queries": cfg.queries, "code": f"imgest {imgest.__version__}, faiss {faiss.__version__}"}
        key = build_key(inputs)
        reused_card = None if cfg.rebuild else reusable_version(store_loc, card_model["slug"], key)
        reused = reused_card is not None
        result = {"built": True, "card": reused_card} if reused else build_version(
            store_loc.url, card_model, cfg.kind, cfg.memory, cfg.target_recall, cfg.k, cfg.queries, cfg.parts,
            cfg.runner, cfg.workers, lock.fence, cfg.rebuild, cfg.retrain_share, cfg.disk)
        if not result["built"]:
            return {**result, "reused": False}
        if not reused:
            record_build(store_loc, card_model["slug"], key, inputs, result["card"], lock.fence)
        card = result["card"]
        moved = verify_and_alias_task(store_loc.url, card, cfg.alias, lock.fence)
    markdown = ("Nothing changed since this version was built: reused, not rebuilt.\n\n" if reused else "") + \
        render_card(card)
    if card["search"]["param"]:  # an ANN index: its recall sweep, the target and the served value
        markdown += "\n\n" + markdown_image(recall_sweep_png(card), "recall sweep")
    create_markdown_artifact(markdown, key="index-card",
                             description=f"index model={card['slug']} v{card['version']:04d}")
    return {"built": True, "reused": reused, "card": card, "aliases": [a["alias"] for a in moved]}
