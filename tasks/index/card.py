"""Assemble an index card: what made the index, what it serves, what it costs (rendered by imgest/reports/index.py)."""

from __future__ import annotations

import faiss

from imgest.names import VERSION, parse_memory
from imgest.retrieval.params import refine_of
from imgest.tasks.index.build import BuildTimes, faiss_blas
from imgest.tasks.index.choice import HNSW_M, RULE, IndexChoice
from imgest.tasks.index.tuning import Tuned


def bytes_per_vector(d: int, choice: IndexChoice) -> dict:
    """The same corpus at each encoding, per vector, so the card shows what the choice saved."""
    return {
        "fp32": 4 * d,
        "fp16": 2 * d,
        "int8": d,
        "pq": choice.pq_m,
        "hnsw_graph_overhead": round(2 * HNSW_M * 4 * 1.1, 1),
    }


def footprint(index, choice: IndexChoice) -> dict:
    """Bytes of the built index where it is served: in RAM (codes, ids, coarse quantizer, codebooks) and on
    local disk (a re-ranking index's float16 vectors, memory-mapped), measured from the index itself."""
    refine = refine_of(index)
    if refine is None:  # the whole index is served from RAM (or its own memory map): bytes_on_disk says how much
        return {"ram_bytes": None, "disk_bytes": 0, "refine": None}
    vectors = faiss.downcast_index(refine.refine_index)
    ram = int(faiss.serialize_index(refine.base_index).nbytes)
    disk = int(vectors.ntotal * vectors.code_size)
    if choice.refine != "disk":
        ram, disk = ram + disk, 0
    return {"ram_bytes": ram, "disk_bytes": disk, "refine": choice.refine,
            "estimated_ram_bytes": choice.estimated_bytes, "estimated_disk_bytes": choice.disk_bytes}


def make_card(model: dict, n: int, d: int, snapshot: int, choice: IndexChoice, memory: str, times: BuildTimes,
              tuned: Tuned, lineage: dict, index=None, disk: str | None = None,
              encoded_by: dict[str, int] | None = None, decoded_by: dict[str, int] | None = None) -> dict:
    """`encoded_by`: the indexed rows per "runtime precision" of the shards they were read from ("unrecorded" for
    shards written before that was recorded), so that a store mixing precisions says so; `decoded_by`: per JPEG
    decoder that made them, so that a model whose decoder was switched says so."""
    return {
        "imgest_version": VERSION,
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
                   "disk_budget": disk, "rule": RULE},
        "metric": "inner product on L2-normalised vectors (cosine)",
        "search": {"param": tuned.param_name, "value": tuned.param, "k_factor": tuned.k_factor},
        "footprint": footprint(index, choice) if index is not None else None,
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
        "encoded_by": None if encoded_by is None else dict(sorted(encoded_by.items())),
        "decoded_by": None if decoded_by is None else dict(sorted(decoded_by.items())),
    }

