"""Exact neighbours of a fixed probe set, kept deeper than k so that a version updated in place can carry them
forward (drop what left, merge what arrived) instead of scanning every vector again.

The invariant, per query: every indexed vector that is not in its list scores at most `floor`. Removing
list entries keeps it; an added vector scoring above `floor` joins the list; cutting the list back to its
depth raises `floor` to the best score cut. A query's top-k is therefore exact while at least k entries
score above `floor`; a query below that is set aside (not guessed) until the next full build.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

TIE = 1e-6  # scores this close to the k-th exact score count as hits: equal-distance neighbours are not misses
CARRY_BLOCK = 4096  # added vectors scored against the probes at a time: Q x block floats, never Q x all added


@dataclass
class Truth:
    query_ids: np.ndarray  # (Q,) faiss id of each probe's own item (excluded from its neighbours), -1: gone
    queries: np.ndarray  # (Q, d) float32 probe vectors (the items' vectors when sampled)
    ids: np.ndarray  # (Q, D) faiss ids of the exact neighbours, best first, -1 padding
    scores: np.ndarray  # (Q, D) their inner products, -inf padding
    floor: np.ndarray  # (Q,) every vector not listed scores at most this

    @property
    def depth(self) -> int:
        return self.ids.shape[1]

    def usable(self, k: int) -> np.ndarray:
        """Queries whose exact top-k is known: at least k listed entries score above the floor."""
        return ((self.ids >= 0) & (self.scores > self.floor[:, None] + TIE)).sum(axis=1) >= k

    def to_table(self) -> pa.Table:
        d = self.queries.shape[1]
        return pa.table({
            "query_id": pa.array(self.query_ids, pa.int64()),
            "query": pa.FixedSizeListArray.from_arrays(pa.array(self.queries.ravel(), pa.float32()), d),
            "ids": pa.FixedSizeListArray.from_arrays(pa.array(self.ids.ravel(), pa.int64()), self.depth),
            "scores": pa.FixedSizeListArray.from_arrays(pa.array(self.scores.ravel(), pa.float32()), self.depth),
            "floor": pa.array(self.floor, pa.float32()),
        })

    @classmethod
    def from_table(cls, table: pa.Table) -> Truth:
        def matrix(name: str, dtype) -> np.ndarray:
            column = table[name].combine_chunks()
            return column.values.to_numpy().astype(dtype).reshape(len(table), column.type.list_size)

        return cls(table["query_id"].to_numpy().astype(np.int64), matrix("query", np.float32),
                   matrix("ids", np.int64), matrix("scores", np.float32), table["floor"].to_numpy().astype(np.float32))


def exact_truth(vectors: np.ndarray, query_ids: np.ndarray, depth: int) -> Truth:
    """Exact top-`depth` neighbours of the vectors at `query_ids` (faiss id = row), each query's own row left
    out. faiss.knn scans the array in place (a memory map stays one): no second copy of the vectors."""
    import faiss

    depth = min(depth, len(vectors) - 1)
    queries = np.ascontiguousarray(vectors[query_ids], np.float32)
    scores, ids = faiss.knn(queries, vectors, depth + 1, metric=faiss.METRIC_INNER_PRODUCT)
    out_s = np.full((len(query_ids), depth), -np.inf, np.float32)
    out_i = np.full((len(query_ids), depth), -1, np.int64)
    for row, q in enumerate(query_ids):
        keep = (ids[row] != q) & (ids[row] >= 0)
        out_s[row], out_i[row] = scores[row][keep][:depth], ids[row][keep][:depth]
    # everything unlisted scores at most the last listed score (or anything, when the list is short)
    floor = np.where(len(vectors) - 1 > depth, out_s[:, -1], -np.inf).astype(np.float32)
    return Truth(np.asarray(query_ids, np.int64), queries, out_i, out_s, floor)


def carry_truth(truth: Truth, remap: np.ndarray, added_ids: np.ndarray, added: np.ndarray) -> Truth:
    """The truth after an update: old faiss ids renamed by `remap` (old id -> new id, -1 when the vector left),
    the `added` vectors (new ids `added_ids`) merged in by exact score. Exact for every query that stays
    `usable`; see the module doc for why."""
    def rename(ids: np.ndarray) -> np.ndarray:
        return np.where(ids >= 0, remap[np.clip(ids, 0, None)], -1)

    ids, scores = rename(truth.ids), truth.scores.copy()
    scores[ids < 0] = -np.inf
    query_ids = np.where(truth.query_ids >= 0, rename(truth.query_ids), -1)
    added, added_ids = np.ascontiguousarray(added, np.float32), np.asarray(added_ids, np.int64)
    keep = truth.depth + 1  # of each block: its best depth + 1 hold the final top `depth` and the best left out
    id_parts, score_parts = [ids], [scores]
    for start in range(0, len(added), CARRY_BLOCK):  # (Q, block) scores at a time: the only new work
        block_ids = added_ids[start:start + CARRY_BLOCK]
        new_scores = truth.queries @ added[start:start + CARRY_BLOCK].T
        new_scores[block_ids[None, :] == query_ids[:, None]] = -np.inf  # never a query's own item
        new_scores[new_scores <= truth.floor[:, None]] = -np.inf  # below the floor: covered by the invariant
        if new_scores.shape[1] > keep:
            best = np.argpartition(-new_scores, keep - 1, axis=1)[:, :keep]
            id_parts.append(block_ids[best])
            score_parts.append(np.take_along_axis(new_scores, best, 1))
        else:
            id_parts.append(np.broadcast_to(block_ids, new_scores.shape))
            score_parts.append(new_scores)
    ids, scores = np.concatenate(id_parts, axis=1), np.concatenate(score_parts, axis=1).astype(np.float32)
    order = np.argsort(-scores, axis=1, kind="stable")
    ids, scores = np.take_along_axis(ids, order, 1), np.take_along_axis(scores, order, 1)
    ids[~np.isfinite(scores)] = -1
    depth = truth.depth
    cut = scores[:, depth:]
    floor = np.maximum(truth.floor, cut.max(axis=1, initial=-np.inf)).astype(np.float32)
    return Truth(query_ids, truth.queries, ids[:, :depth].copy(), scores[:, :depth].copy(), floor)


def truth_recall(found: np.ndarray, truth: Truth, k: int, rows: np.ndarray | None = None) -> float:
    """recall@k of `found` (faiss ids, one row per query, at least k+1 wide) against the exact lists: a hit is a
    found id, other than the query's own, whose exact score is within TIE of the k-th exact score or above.
    Only `rows` (default: the usable queries) are measured."""
    rows = np.flatnonzero(truth.usable(k)) if rows is None else rows
    if len(rows) == 0:
        return 0.0
    hits = 0
    for row in rows:
        got = found[row][(found[row] >= 0) & (found[row] != truth.query_ids[row])][:k]
        listed = dict(zip(truth.ids[row].tolist(), truth.scores[row].tolist()))
        kth = truth.scores[row, k - 1]
        hits += sum(1 for i in got.tolist() if listed.get(i, -np.inf) >= kth - TIE)
    return hits / (len(rows) * k)
