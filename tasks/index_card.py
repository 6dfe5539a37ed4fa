"""Assemble an index card: what made the index, what it serves, what it costs (rendered by tasks/markdown.py)."""

from __future__ import annotations

import faiss
import numpy as np
import pyarrow as pa

import imgest
from imgest.tasks.index_build import BuildTimes, faiss_blas
from imgest.tasks.index_choice import HNSW_M, RULE, IndexChoice, parse_memory
from imgest.tasks.live import LiveVectors
from imgest.tasks.recall_tuning import Tuned


def bytes_per_vector(d: int, choice: IndexChoice) -> dict:
    """The same corpus at each encoding, per vector, so the card shows what the choice saved."""
    return {
        "fp32": 4 * d,
        "fp16": 2 * d,
        "int8": d,
        "pq": choice.pq_m,
        "hnsw_graph_overhead": round(2 * HNSW_M * 4 * 1.1, 1),
    }


def make_card(model: dict, n: int, d: int, snapshot: int, choice: IndexChoice, memory: str, times: BuildTimes,
              tuned: Tuned, lineage: dict) -> dict:
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
            "against": "exact inner-product search on the same vectors (lists kept 3k deep, carried through "
                       "updates); query item excluded; ties tolerated",
            "sweep": [p.__dict__ for p in tuned.sweep],
        },
        "latency_ms_per_query": tuned.ms_per_query,
        "bytes_per_vector_by_encoding": bytes_per_vector(d, choice),
        "times": times.__dict__,
        "snapshot": snapshot,
        "lineage": lineage,
    }


def ids_table(live: LiveVectors) -> pa.Table:
    return pa.table({"faiss_id": pa.array(np.arange(len(live)), pa.int64()), "item_id": live.item_ids,
                     "uri": live.uris, "content_hash": live.content_hashes})
