"""A large IVF build, nothing shipped from the flow's node: the flow reads only the training shards (and the
recall probes among them), each part task reads its own shards from the store, adds them with their faiss ids
and computes the probes' exact neighbours among its vectors; the flow merges the inverted lists (faiss
merge_from, ids kept) and the partial neighbour lists. Same index as one process trained on the same rows."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from imgest.state.live import LiveShards, read_vectors
from imgest.storage import Location
from imgest.tasks.index.truth import Truth


@dataclass(frozen=True)
class PartSpec:
    """One part's work: its shards and, per shard, the live item ids and their faiss ids (rows in item_id order)."""

    store_url: str
    slug: str
    dim: int
    shards: tuple[str, ...]
    counts: tuple[int, ...]  # live rows in each shard
    item_ids: pa.Array  # the part's live items, grouped by shard in `shards` order
    faiss_ids: np.ndarray  # their faiss ids, aligned with item_ids

    @property
    def rows(self) -> int:
        return len(self.item_ids)


def plan_parts(store_url: str, slug: str, dim: int, live: LiveShards, parts: int) -> list[PartSpec]:
    """Cut the live set into `parts` groups of whole shards with near-equal row counts (one read of its shards
    file: the parts' ids are Arrow columns, shipped to the runner with their specs)."""
    counts = live.counts["rows"].to_numpy()
    ends = np.cumsum(counts)
    bounds = np.searchsorted(ends, np.linspace(0, live.rows, min(parts, max(len(ends), 1)) + 1)[1:-1], side="right")
    part_of = np.zeros(len(ends), np.int64)
    part_of[bounds[bounds < len(ends)]] += 1
    part_of = np.cumsum(part_of)
    groups: dict[int, list] = {}
    for number, (shard, item_ids, rows) in zip(part_of, live):
        groups.setdefault(int(number), []).append((shard, item_ids, rows))
    return [PartSpec(store_url, slug, dim, tuple(g[0] for g in group), tuple(len(g[1]) for g in group),
                     pa.concat_arrays([g[1] for g in group]), np.concatenate([g[2] for g in group]))
            for _, group in sorted(groups.items())]


def add_store_part(trained: bytes, spec: PartSpec, probes: np.ndarray, depth: int) -> dict:
    """Read the part's shards, add its vectors with their faiss ids to a copy of the trained index, and find
    each probe's `depth` + 1 best among them (exact), counting its rows by what encoded and decoded them. Runs on a
    worker; reads the store itself."""
    import faiss

    store = Location(spec.store_url)
    index = faiss.deserialize_index(np.frombuffer(trained, np.uint8))
    wanted = pa.table({"item_id": spec.item_ids,
                       "shard": pa.array(np.repeat(np.array(spec.shards, dtype=object), spec.counts), pa.string())})
    encoded_by, decoded_by = Counter(), Counter()
    found, vectors = read_vectors(store, spec.slug, spec.dim, wanted, encoded_by, decoded_by)
    if len(found) != spec.rows:
        raise RuntimeError(f"part of {len(spec.shards)} shard(s): {spec.rows - len(found)} live item(s) have no "
                           "row in their shard")
    ids = spec.faiss_ids[pc.index_in(found["item_id"], value_set=spec.item_ids).to_numpy()]
    index.add_with_ids(vectors, ids)
    scores, local = faiss.knn(probes, vectors, min(depth + 1, len(vectors)), metric=faiss.METRIC_INNER_PRODUCT)
    return {"index": faiss.serialize_index(index).tobytes(), "scores": scores, "ids": ids[local],
            "encoded_by": dict(encoded_by), "decoded_by": dict(decoded_by)}


def merge_id_parts(trained: bytes, parts: list[bytes]):
    """The parts' inverted lists in one index, their faiss ids kept (merge_from with no id shift)."""
    import faiss

    index = faiss.deserialize_index(np.frombuffer(trained, np.uint8))
    ivf = faiss.extract_index_ivf(index)
    for data in parts:
        part = faiss.deserialize_index(np.frombuffer(data, np.uint8))  # held: its IVF is a view into it
        ivf.merge_from(faiss.extract_index_ivf(part), 0)
    index.ntotal = ivf.ntotal  # an IndexPreTransform (OPQ) wrapper counts on its own
    return index


def merge_truth(probes: np.ndarray, probe_ids: np.ndarray, results: list[dict], n: int, depth: int) -> Truth:
    """The probes' exact neighbours over all parts: each part's best depth + 1, merged, the probe's own row out."""
    width = depth + 1
    padded_s, padded_i = [], []
    for r in results:
        s, i = r["scores"], r["ids"]
        pad = width - s.shape[1]
        padded_s.append(np.pad(s, ((0, 0), (0, pad)), constant_values=-np.inf) if pad > 0 else s)
        padded_i.append(np.pad(i, ((0, 0), (0, pad)), constant_values=-1) if pad > 0 else i)
    scores, ids = np.concatenate(padded_s, axis=1), np.concatenate(padded_i, axis=1)
    scores = np.where((ids == probe_ids[:, None]) | (ids < 0), -np.inf, scores)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :min(depth, n - 1)]
    scores, ids = np.take_along_axis(scores, order, 1).astype(np.float32), np.take_along_axis(ids, order, 1)
    ids[~np.isfinite(scores)] = -1
    floor = np.where(n - 1 > depth, scores[:, -1], -np.inf).astype(np.float32)
    return Truth(probe_ids.astype(np.int64), np.ascontiguousarray(probes, np.float32), ids, scores, floor)
