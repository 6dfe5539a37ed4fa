"""Build a versioned FAISS index of one model's live embeddings, tune it to a recall, move an alias."""

from __future__ import annotations

import os
import socket
import time

import faiss
import numpy as np
from prefect import flow, get_run_logger, tags, unmapped
from prefect.artifacts import create_markdown_artifact
from prefect.utilities.annotations import quote

from flows.config import IndexConfig
from flows.naming import run_name
from flows.runners import shard_runner
from imgest.encoders import DEFAULT_MODEL
from imgest.lock import StoreLock
from imgest.storage import open_location
from tasks.export import find_model
from tasks.index_build import BuildTimes, merge_parts, mergeable, part_ranges
from tasks.index_card import (
    add_part_task,
    build_task,
    load_live_task,
    make_card,
    render_card,
    train_task,
    tune_task,
    verify_and_alias_task,
    write_version_task,
)
from tasks.index_choice import IndexChoice, choose_index
from tasks.plots import markdown_image, recall_sweep_png


def build_in_parts(vectors: np.ndarray, choice: IndexChoice, parts: int, runner: str, workers: int):
    """Train once here; add `parts` contiguous slices in parallel on the runner (local threads or a Dask
    cluster); merge them in id order with faiss's own merge. Same index as one build (tested)."""
    logger = get_run_logger()
    start = time.perf_counter()
    trained = train_task(vectors, choice)
    train_seconds = round(time.perf_counter() - start, 3)
    ranges = part_ranges(len(vectors), parts)
    if not mergeable(faiss.deserialize_index(np.frombuffer(trained, np.uint8))):
        logger.info("%s does not merge (an HNSW graph is one structure): adding in this process, where faiss "
                    "already uses every core", choice.factory)
        ranges = [(0, len(vectors))]
    t0 = time.perf_counter()
    with shard_runner(runner, workers) as part_runner:
        futures = part_runner.map(add_part_task, {"trained": unmapped(trained),
                                                  "vectors": [vectors[a:b] for a, b in ranges],
                                                  "start": [a for a, _ in ranges]})
        index = merge_parts(trained, [f.result() for f in futures])
    add_seconds = round(time.perf_counter() - t0, 3)
    times = BuildTimes(train_seconds, add_seconds, round(time.perf_counter() - start, 3))
    return index, times, len(ranges)


@flow(name="build-index", flow_run_name=run_name("build-index"), validate_parameters=True)
def build_index(store: str, model: str = DEFAULT_MODEL, kind: str = "auto", memory: str = "4G",
                target_recall: float = 0.95, k: int = 10, queries: int = 1000,
                alias: str | None = "auto", parts: int = 1, runner: str = "local", workers: int = 0) -> dict:
    cfg = IndexConfig(store, model, kind, memory, target_recall, k, queries, alias, parts, runner, workers)
    store_loc = open_location(cfg.store, must_exist=True, what="store")
    card_model = find_model(store_loc, cfg.model)
    with tags(f"model:{card_model['slug']}"), \
            StoreLock(store_loc, owner=f"build-index@{socket.gethostname()}:{os.getpid()}"):
        live = load_live_task(store_loc.url, card_model)
        if len(live) < 2:
            return {"built": False, "reason": f"{len(live)} live vectors: nothing to index", "slug": card_model["slug"]}
        choice = choose_index(len(live), live.vectors.shape[1], cfg.memory, cfg.kind)
        if cfg.parts > 1:
            index, times, used = build_in_parts(live.vectors, choice, cfg.parts, cfg.runner, cfg.workers)
        else:
            (index, times), used = build_task(live.vectors, choice), 1
        tuned = tune_task(index, live.vectors, cfg.target_recall, cfg.k, cfg.queries)
        card = make_card(card_model, live, choice, cfg.memory, times, tuned)
        card["build"] = {"parts": used, "runner": cfg.runner if cfg.runner in ("local", "dask") else "dask (remote)",
                         "method": "one process" if used == 1 else "trained once, parts added in parallel, "
                                                                   "merged in id order (faiss merge_from)"}
        card = write_version_task(store_loc.url, index, quote(live), card)
        moved = verify_and_alias_task(store_loc.url, card, cfg.alias)
    markdown = render_card(card)
    if card["search"]["param"]:  # an ANN index: its recall sweep, the target and the served value
        markdown += "\n\n" + markdown_image(recall_sweep_png(card), "recall sweep")
    create_markdown_artifact(markdown, key="index-card",
                             description=f"index model={card['slug']} v{card['version']:04d}")
    return {"built": True, "card": card, "aliases": [a["alias"] for a in moved]}
