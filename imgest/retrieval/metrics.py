"""Retrieval metrics: per-query kernels, a public function taking names like "recall@10", and a paired bootstrap.

A run maps a query id to its ranked item ids (best first); qrels map a query id to its relevant ids.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import numpy as np

Run = dict[str, Sequence[str]]
Qrels = dict[str, set[str]]


def _hit(ranked: Sequence[str], relevant: set[str], k: int) -> float:
    return float(any(doc in relevant for doc in ranked[:k]))


def _precision(ranked: Sequence[str], relevant: set[str], k: int) -> float:
    return sum(doc in relevant for doc in ranked[:k]) / k


def _reciprocal_rank(ranked: Sequence[str], relevant: set[str], k: int | None) -> float:
    for rank, doc in enumerate(ranked[:k] if k else ranked, start=1):
        if doc in relevant:
            return 1.0 / rank
    return 0.0


def _average_precision(ranked: Sequence[str], relevant: set[str], k: int | None) -> float:
    if not relevant:
        return 0.0
    hits, total = 0, 0.0
    for rank, doc in enumerate(ranked[:k] if k else ranked, start=1):
        if doc in relevant:
            hits += 1
            total += hits / rank
    return total / len(relevant)


_KERNELS: dict[str, Callable[[Sequence[str], set[str], int | None], float]] = {
    "recall": _hit,
    "precision": _precision,
    "mrr": _reciprocal_rank,
    "map": _average_precision,
}
_NAME = re.compile(r"^(recall|precision|mrr|map)(?:@(\d+))?$")


def parse_metric(name: str) -> tuple[str, int | None]:
    match = _NAME.match(name.strip().lower())
    if not match or (match.group(1) in ("recall", "precision") and not match.group(2)):
        raise ValueError(f"unknown metric {name!r}; allowed: recall@K, precision@K, mrr[@K], map[@K]")
    return match.group(1), int(match.group(2)) if match.group(2) else None


def per_query(run: Run, qrels: Qrels, metric: str) -> dict[str, float]:
    """One value per query of ``qrels`` (a query missing from the run scores 0).

    - ``recall@K``: 1 if at least one relevant item is in the top K, else 0 (success@K in trec_eval).
    - ``precision@K``: |relevant in top K| / K.
    - ``mrr`` / ``mrr@K``: 1 / rank of the first relevant item (0 when none is retrieved, or not in top K).
    - ``map`` / ``map@K``: average precision, sum over relevant items retrieved at rank r of P@r,
      divided by the number of relevant items (trec_eval's map); mAP is its mean over queries.
    """
    kind, k = parse_metric(metric)
    kernel = _KERNELS[kind]
    return {q: kernel(list(run.get(q, ())), rel, k) for q, rel in qrels.items()}


def evaluate(run: Run, qrels: Qrels, metrics: Sequence[str]) -> dict[str, float]:
    """Mean of each metric over the queries of ``qrels``."""
    return {m: float(np.mean(list(per_query(run, qrels, m).values()))) if qrels else 0.0 for m in metrics}


def paired_bootstrap(a: Sequence[float], b: Sequence[float], resamples: int = 1000, seed: int = 0,
                     confidence: float = 0.95) -> dict:
    """Interval on mean(b) - mean(a) by resampling queries with replacement, the same queries for both
    retrievers each time (paired). Percentile interval; ``samples`` is the bootstrap distribution."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) != len(b) or len(a) == 0:
        raise ValueError("paired bootstrap needs two equal, non-empty lists of per-query values")
    rng = np.random.default_rng(seed)
    index = rng.integers(0, len(a), size=(resamples, len(a)))
    samples = b[index].mean(axis=1) - a[index].mean(axis=1)
    low, high = np.percentile(samples, [(1 - confidence) / 2 * 100, (1 + confidence) / 2 * 100])
    return {"difference": float(b.mean() - a.mean()), "low": float(low), "high": float(high),
            "confidence": confidence, "resamples": resamples, "seed": seed, "samples": samples.tolist(),
            "p_b_not_better": float(np.mean(samples <= 0))}


def win_loss(a_hits: dict[str, float], b_hits: dict[str, float]) -> dict:
    """The four cells of two retrievers' per-query hits, with shares and the union ceiling."""
    queries = list(a_hits)
    cells = {"both_hit": 0, "a_only": 0, "b_only": 0, "both_miss": 0}
    for q in queries:
        a, b = a_hits[q] > 0, b_hits[q] > 0
        cells["both_hit" if a and b else "a_only" if a else "b_only" if b else "both_miss"] += 1
    n = len(queries)
    return {"counts": cells, "shares": {k: v / n if n else 0.0 for k, v in cells.items()}, "queries": n,
            "union_ceiling": (n - cells["both_miss"]) / n if n else 0.0}
