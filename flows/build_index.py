"""Build a versioned FAISS index of one model's live embeddings, tune it to a recall, move an alias."""

from __future__ import annotations

import os
import socket

from prefect import flow, tags
from prefect.artifacts import create_markdown_artifact
from prefect.utilities.annotations import quote

from flows.config import IndexConfig
from flows.naming import run_name
from imgest.encoders import DEFAULT_MODEL
from imgest.lock import StoreLock
from imgest.storage import open_location
from tasks.export import find_model
from tasks.index_card import (
    build_task,
    load_live_task,
    make_card,
    render_card,
    tune_task,
    verify_and_alias_task,
    write_version_task,
)
from tasks.index_choice import choose_index
from tasks.plots import markdown_image, recall_sweep_png


@flow(name="build-index", flow_run_name=run_name("build-index"), validate_parameters=True)
def build_index(store: str, model: str = DEFAULT_MODEL, kind: str = "auto", memory: str = "4G",
                target_recall: float = 0.95, k: int = 10, queries: int = 1000,
                alias: str | None = "auto") -> dict:
    cfg = IndexConfig(store, model, kind, memory, target_recall, k, queries, alias)
    store_loc = open_location(cfg.store, must_exist=True, what="store")
    card_model = find_model(store_loc, cfg.model)
    with tags(f"model:{card_model['slug']}"), \
            StoreLock(store_loc, owner=f"build-index@{socket.gethostname()}:{os.getpid()}"):
        live = load_live_task(store_loc.url, card_model)
        if len(live) < 2:
            return {"built": False, "reason": f"{len(live)} live vectors: nothing to index", "slug": card_model["slug"]}
        choice = choose_index(len(live), live.vectors.shape[1], cfg.memory, cfg.kind)
        index, times = build_task(live.vectors, choice)
        tuned = tune_task(index, live.vectors, cfg.target_recall, cfg.k, cfg.queries)
        card = write_version_task(store_loc.url, index, quote(live),
                                  make_card(card_model, live, choice, cfg.memory, times, tuned))
        moved = verify_and_alias_task(store_loc.url, card, cfg.alias)
    markdown = render_card(card)
    if card["search"]["param"]:  # an ANN index: its recall sweep, the target and the served value
        markdown += "\n\n" + markdown_image(recall_sweep_png(card), "recall sweep")
    create_markdown_artifact(markdown, key="index-card",
                             description=f"index model={card['slug']} v{card['version']:04d}")
    return {"built": True, "card": card, "aliases": [a["alias"] for a in moved]}
