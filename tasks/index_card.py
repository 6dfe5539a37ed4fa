"""Assemble an index card (what made the index, what it serves, what it costs) and render it."""

from __future__ import annotations

import faiss
import numpy as np
import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

import imgest
from imgest.storage import Location
from tasks.index_build import (
    BuildTimes,
    Tuned,
    add_part,
    build,
    faiss_blas,
    train,
    tune_search,
    warn_if_generic_blas,
)
from tasks.index_choice import HNSW_M, RULE, IndexChoice, parse_memory
from tasks.index_store import list_aliases, open_index, read_alias, set_alias, write_version
from tasks.live import LiveVectors, load_live_vectors
from tasks.policy import IO_RETRIES


def bytes_per_vector(d: int, choice: IndexChoice) -> dict:
    """The same corpus at each encoding, per vector, so the card shows what the choice saved."""
    return {
        "fp32": 4 * d,
        "fp16": 2 * d,
        "int8": d,
        "pq": choice.pq_m,
        "hnsw_graph_overhead": round(2 * HNSW_M * 4 * 1.1, 1),
    }


def make_card(model: dict, live: LiveVectors, choice: IndexChoice, memory: str, times: BuildTimes,
              tuned: Tuned) -> dict:
    n, d = live.vectors.shape
    return {
        "imgest_version": imgest.__version__,
        "faiss_version": faiss.__version__,
        "faiss_blas": faiss_blas(),
        "model_id": model["model_id"],
        "model_name": model["name"],
        "slug": model["slug"],
        "n": n,
        "d": d,
        "factory": choice.factory,
        "kind": choice.kind,
        "choice": {**choice.to_dict(), "memory_budget": memory, "memory_budget_bytes": parse_memory(memory),
                   "rule": RULE},
        "metric": "inner product on L2-normalised vectors (cosine)",
        "search": {"param": tuned.param_name, "value": tuned.param},
        "recall": {
            f"recall@{tuned.k}": tuned.recall,
            "k": tuned.k,
            "target": tuned.target,
            "met": tuned.met,
            "queries": tuned.queries,
            "against": "exact inner-product search (Flat) on the same vectors; query item excluded; ties tolerated",
            "sweep": [p.__dict__ for p in tuned.sweep],
        },
        "latency_ms_per_query": tuned.ms_per_query,
        "bytes_per_vector_by_encoding": bytes_per_vector(d, choice),
        "times": times.__dict__,
        "snapshot": live.snapshot,
    }


def ids_table(live: LiveVectors) -> pa.Table:
    return pa.table({"faiss_id": pa.array(np.arange(len(live)), pa.int64()), "item_id": live.item_ids,
                     "uri": live.uris, "content_hash": live.content_hashes})


def render_card(card: dict) -> str:
    rec = card["recall"]
    served_recall = rec[f"recall@{rec['k']}"]
    verdict = "meets" if rec["met"] else "**DOES NOT MEET**"
    lines = [
        f"## Index `model={card['slug']}` v{card['version']:04d}",
        "",
        f"- model: `{card['model_id']}`; {card['n']} vectors of d={card['d']} from snapshot {card['snapshot']}",
        f"- index: `{card['factory']}` ({card['choice']['reason']}); memory budget {card['choice']['memory_budget']}",
        f"- served: {served_parameters(card)}; recall@{rec['k']} "
        f"{served_recall} on {rec['queries']} held-out queries, {verdict} the target {rec['target']}",
        f"- latency: {card['latency_ms_per_query']} ms/query (batched); {card['bytes_on_disk']} bytes on disk, "
        f"{card['bytes_on_disk'] / max(card['n'], 1):.1f} bytes/vector",
        f"- build: train {card['times']['train_seconds']} s, add {card['times']['add_seconds']} s, "
        f"total {card['times']['total_seconds']} s"
        + (f" ({card['build']['parts']} parts added in parallel on {card['build']['runner']}, merged)"
           if card.get("build", {}).get("parts", 1) > 1 else "")
        + f"; sha256 `{card['sha256'][:16]}...`",
        "",
        f"| {card['search']['param'] or 'exact'} | recall@{rec['k']} | ms/query |",
        "|---:|---:|---:|",
    ]
    lines += [f"| {p['param']} | {p['recall']} | {p['ms_per_query']} |" for p in rec["sweep"]]
    return "\n".join(lines) + "\n"


@task(name="load-live-vectors", cache_policy=NO_CACHE, **IO_RETRIES)
def load_live_task(store_url: str, model: dict) -> LiveVectors:
    return load_live_vectors(Location(store_url), model["slug"], int(model["dim"]))


@task(name="build-index", cache_policy=NO_CACHE)
def build_task(vectors: np.ndarray, choice: IndexChoice):
    warn_if_generic_blas()
    return build(vectors, choice)


@task(name="train-index", cache_policy=NO_CACHE)
def train_task(vectors: np.ndarray, choice: IndexChoice) -> bytes:
    warn_if_generic_blas()
    return faiss.serialize_index(train(vectors, choice)).tobytes()


@task(name="add-part", cache_policy=NO_CACHE, retries=1, task_run_name="add-part-{start}")
def add_part_task(trained: bytes, vectors: np.ndarray, start: int) -> tuple[int, bytes]:
    return start, add_part(trained, vectors)


@task(name="tune-search", cache_policy=NO_CACHE)
def tune_task(index, vectors: np.ndarray, target: float, k: int, queries: int) -> Tuned:
    return tune_search(index, vectors, target, k, queries)


@task(name="write-version", cache_policy=NO_CACHE, **IO_RETRIES)
def write_version_task(store_url: str, index, live: LiveVectors, card: dict) -> dict:
    data = faiss.serialize_index(index).tobytes()
    return write_version(Location(store_url), card["slug"], data, ids_table(live), card)


def aliases_to_move(store: Location, slug: str, alias: str | None) -> list[str]:
    """'auto': every alias already on this model follows its rebuilds, and `serving` is created when
    the store has none; a name: that alias too; None: no alias moves."""
    if alias is None:
        return []
    names = set(follower_aliases(store, slug))
    if alias == "auto":
        if read_alias(store, "serving") is None:
            names.add("serving")
    else:
        names.add(alias)
    return sorted(names)


def follower_aliases(store: Location, slug: str) -> list[str]:
    return sorted(name for name, entry in list_aliases(store).items() if entry["slug"] == slug)


@task(name="verify-and-alias", cache_policy=NO_CACHE)
def verify_and_alias_task(store_url: str, card: dict, alias: str | None) -> list[dict]:
    """Re-open the written version (checksums, vector count) before any alias points at it."""
    store = Location(store_url)
    opened = open_index(store, card["slug"], card["version"])
    if opened.index.ntotal != card["n"] or len(opened.item_ids) != card["n"]:
        raise RuntimeError(f"index v{card['version']} holds {opened.index.ntotal} vectors, card says {card['n']}")
    return [set_alias(store, name, card, reason=f"build v{card['version']:04d}")
            for name in aliases_to_move(store, card["slug"], alias)]


def served_parameters(card: dict) -> str:
    search = card["search"]
    return f"{search['param']}={search['value']}" if search["param"] else "exact search"
