"""Build a versioned FAISS index of one model's live embeddings, tune it to a recall, move an alias."""

from __future__ import annotations

import os
import socket
import time

import faiss
import numpy as np
from prefect import flow, get_run_logger, tags, task, unmapped
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import INPUTS
from prefect.utilities.annotations import quote

import imgest
from flows.config import IndexConfig
from flows.naming import run_name
from flows.runners import shard_runner
from imgest.encoders import DEFAULT_MODEL
from imgest.lock import StoreLock
from imgest.storage import open_location, result_storage
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
from tasks.index_store import version_exists
from tasks.live import live_fingerprint
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


@task(name="build-version", cache_policy=INPUTS - "store_url" - "parts" - "runner" - "workers",
      result_serializer="json", persist_result=True)
def build_version(store_url: str, model: dict, live_state: str, kind: str, memory: str, target_recall: float,
                  k: int, queries: int, code: str, parts: int, runner: str, workers: int) -> dict:
    """Load, build, tune and write one version. Cached by what determines the index (the live state,
    the model, the choice and tuning parameters, the code): a nightly with nothing new reuses the last
    version instead of rebuilding it. The cache records live in the store (`cache/prefect/`)."""
    live = load_live_task(store_url, model)
    if len(live) < 2:
        return {"built": False, "reason": f"{len(live)} live vectors: nothing to index", "slug": model["slug"]}
    choice = choose_index(len(live), live.vectors.shape[1], memory, kind)
    if parts > 1:
        index, times, used = build_in_parts(live.vectors, choice, parts, runner, workers)
    else:
        (index, times), used = build_task(live.vectors, choice), 1
    tuned = tune_task(index, live.vectors, target_recall, k, queries)
    card = make_card(model, live, choice, memory, times, tuned)
    card["build"] = {"parts": used, "runner": runner if runner in ("local", "dask") else "dask (remote)",
                     "method": "one process" if used == 1 else "trained once, parts added in parallel, "
                                                               "merged in id order (faiss merge_from)"}
    return {"built": True, "card": write_version_task(store_url, index, quote(live), card)}


@flow(name="build-index", flow_run_name=run_name("build-index"), validate_parameters=True)
def build_index(store: str, model: str = DEFAULT_MODEL, kind: str = "auto", memory: str = "4G",
                target_recall: float = 0.95, k: int = 10, queries: int = 1000,
                alias: str | None = "auto", parts: int = 1, runner: str = "local", workers: int = 0,
                rebuild: bool = False) -> dict:
    cfg = IndexConfig(store, model, kind, memory, target_recall, k, queries, alias, parts, runner, workers)
    store_loc = open_location(cfg.store, must_exist=True, what="store")
    card_model = find_model(store_loc, cfg.model)
    with tags(f"model:{card_model['slug']}"), \
            StoreLock(store_loc, owner=f"build-index@{socket.gethostname()}:{os.getpid()}"):
        inputs = {"store_url": store_loc.url, "model": card_model,
                  "live_state": live_fingerprint(store_loc, card_model["slug"]),
                  "kind": cfg.kind, "memory": cfg.memory, "target_recall": cfg.target_recall, "k": cfg.k,
                  "queries": cfg.queries, "code": f"imgest {imgest.__version__}, faiss {faiss.__version__}",
                  "parts": cfg.parts, "runner": cfg.runner, "workers": cfg.workers}
        cached = build_version.with_options(result_storage=result_storage(store_loc), refresh_cache=rebuild or None)
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
