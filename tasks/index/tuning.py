"""Tune an index's search parameters (efSearch, nprobe; with a re-rank, nprobe and k_factor together) to a
measured recall@k against exact search."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import numpy as np

from imgest.retrieval.params import param_name, refine_of, set_param
from imgest.tasks.index.truth import Truth, exact_truth, truth_recall
from imgest.timing import Stopwatch

EF_SEARCH = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
K_FACTORS = (1, 2, 4, 8, 16, 32, 64)  # re-rank k x k_factor candidates from the PQ search
PLATEAU = 0.002  # an nprobe step gaining less recall than this: more lists will not reach the target


@dataclass
class RecallPoint:
    param: int | None
    recall: float
    ms_per_query: float
    k_factor: int | None = None  # candidates re-ranked per result (a re-ranking index only)


@dataclass
class Tuned:
    param_name: str | None  # efSearch, nprobe, or None for exact
    param: int | None
    recall: float
    target: float
    met: bool
    k: int
    queries: int
    ms_per_query: float
    sweep: list[RecallPoint] = field(default_factory=list)
    k_factor: int | None = None  # served re-rank factor (a re-ranking index only)
    truth: Truth | None = field(default=None, repr=False, compare=False)  # the exact lists measured against

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("truth", "sweep")}
        return {**out, "sweep": [asdict(p) for p in self.sweep]}


def candidates(index, name: str | None) -> list[int | None]:
    import faiss

    if name == "nprobe":
        nlist = faiss.extract_index_ivf(index).nlist
        return [p for p in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096) if p < nlist] + [nlist]
    if name == "efSearch":
        return list(EF_SEARCH)
    return [None]


def sample_queries(n: int, count: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n, size=min(count, n), replace=False))


def exact_neighbours(vectors: np.ndarray, query_ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k by inner product for corpus members, the query itself excluded (self-match). faiss.knn
    searches the array in place: no flat index holding a second copy of every vector."""
    import faiss

    scores, ids = faiss.knn(vectors[query_ids], vectors, k + 1, metric=faiss.METRIC_INNER_PRODUCT)
    return _drop_self(scores, ids, query_ids, k)


def _drop_self(scores: np.ndarray, ids: np.ndarray, query_ids: np.ndarray, k: int):
    out_s, out_i = np.empty((len(ids), k), np.float32), np.empty((len(ids), k), np.int64)
    for row, (s, i, q) in enumerate(zip(scores, ids, query_ids)):
        keep = i != q
        out_s[row], out_i[row] = s[keep][:k], i[keep][:k]
    return out_s, out_i


def knn_recall(vectors: np.ndarray, query_ids: np.ndarray, found: np.ndarray, truth_scores: np.ndarray,
               k: int) -> float:
    """recall@k against exact search, tolerating ties: a found id counts when its exact score is at
    least the k-th exact score (minus 1e-6), so equal-distance neighbours are not penalised."""
    hits = 0
    for row, q in enumerate(query_ids):
        ids = found[row][(found[row] >= 0) & (found[row] != q)][:k]
        if len(ids) == 0:
            continue
        true_scores = vectors[ids] @ vectors[q]
        hits += min(k, int(np.sum(true_scores >= truth_scores[row, k - 1] - 1e-6)))
    return hits / (len(query_ids) * k)


TRUTH_DEPTH_PER_K = 3  # exact lists kept 3k deep: an update that removes some neighbours still knows the top k


def tune_search(index, vectors: np.ndarray, target: float = 0.95, k: int = 10, queries: int = 1000,
                seed: int = 0) -> Tuned:
    """Sweep efSearch / nprobe upwards; serve the smallest value whose measured recall@k meets target."""
    n = len(vectors)
    k = max(1, min(k, n - 1))
    return tune_with_truth(index, exact_truth(vectors, sample_queries(n, queries, seed), TRUTH_DEPTH_PER_K * k),
                           target, k)


def tune_with_truth(index, truth: Truth, target: float, k: int) -> Tuned:
    """The sweep against exact lists already known (a fresh build's, or those carried through an update); the
    queries whose exact top-k is no longer known are left out and the count says so. An index that re-ranks
    sweeps nprobe at each k_factor (until the target or a plateau) and serves the fastest pair that meets the
    target; ties go to the smaller pair."""
    k = max(1, min(k, truth.depth))
    rows = np.flatnonzero(truth.usable(k))
    queries = truth.queries[rows]
    name = param_name(index)
    sweep: list[RecallPoint] = []
    for factor in K_FACTORS if refine_of(index) is not None else (None,):
        before = -1.0
        for value in candidates(index, name):
            set_param(index, name, value, factor)
            with Stopwatch() as searching:
                _, ids = index.search(queries, k + 1)
            ms = searching.elapsed * 1000 / max(len(rows), 1)
            found = np.full((len(truth.query_ids), k + 1), -1, np.int64)
            found[rows] = ids
            sweep.append(RecallPoint(value, round(truth_recall(found, truth, k, rows), 4), round(ms, 4), factor))
            if sweep[-1].recall >= target or (factor is not None and sweep[-1].recall - before < PLATEAU):
                break
            before = sweep[-1].recall
    met = [p for p in sweep if p.recall >= target]
    best = min(met, key=lambda p: (p.ms_per_query, p.k_factor or 0, p.param or 0)) if met else \
        max(sweep, key=lambda p: p.recall)
    set_param(index, name, best.param, best.k_factor)
    return Tuned(name, best.param, best.recall, target, bool(met), k, len(rows), best.ms_per_query, sweep,
                 best.k_factor, truth)
