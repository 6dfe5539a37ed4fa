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
    DEFAULT_INDEX_PARTS,
    DEFAULT_K,
    DEFAULT_KIND,
    DEFAULT_MEMORY,
    DEFAULT_MODEL,
    DEFAULT_RECALL_QUERIES,
    DEFAULT_RUNNER,
    DEFAULT_TARGET_RECALL,
    DEFAULT_WORKERS,
)
from imgest.lock import StoreLock
from imgest.storage import open_location, result_storage
from imgest.tasks.index_store import version_exists
from imgest.tasks.index_tasks import build_version, verify_and_alias_task
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
                rebuild: bool = False) -> dict:
    cfg = IndexConfig(store=store, model=model, kind=kind, memory=memory, target_recall=target_recall, k=k,
                      queries=queries, alias=alias, parts=parts, runner=runner, workers=workers, rebuild=rebuild)
    store_loc = open_location(cfg.store, must_exist=True, what="store")
    card_model = find_model(store_loc, cfg.model)
    with tags(f"model:{card_model['slug']}"), \
            StoreLock(store_loc, owner=f"build-index@{socket.gethostname()}:{os.getpid()}"):
        inputs = {"store_url": store_loc.url, "model": card_model,
                  "live_state": live_fingerprint(store_loc, card_model["slug"]),
                  "kind": cfg.kind, "memory": cfg.memory, "target_recall": cfg.target_recall, "k": cfg.k,
                  "queries": cfg.queries, "code": f"imgest {imgest.__version__}, faiss {faiss.__version__}",
                  "parts": cfg.parts, "runner": cfg.runner, "workers": cfg.workers}
        cached = build_version.with_options(result_storage=result_storage(store_loc), refresh_cache=cfg.rebuild or None)
        state = cached(**inputs, return_state=True)
        result = state.result()
        reused = state.is_completed() and state.name == "Cached"
        if reused and result["built"] and not version_exists(store_loc, result["card"]):
            # the cached version was removed since (retired model, deleted by hand): build it again
            result = cached.with_options(refresh_cache=True)(**inputs)
            reused = False
        if not result["built"]:
            return {**result, "reused": reused}
        card = result["card"]
        moved = verify_and_alias_task(store_loc.url, card, cfg.alias)
    markdown = ("Nothing changed since this version was built: reused, not rebuilt.\n\n" if reused else "") + \
        render_card(card)
    if card["search"]["param"]:  # an ANN index: its recall sweep, the target and the served value
        markdown += "\n\n" + markdown_image(recall_sweep_png(card), "recall sweep")
    create_markdown_artifact(markdown, key="index-card",
                             description=f"index model={card['slug']} v{card['version']:04d}")
    return {"built": True, "reused": reused, "card": card, "aliases": [a["alias"] for a in moved]}
