"""Rank fusion of several retrievers' result lists."""

from __future__ import annotations

from collections import defaultdict

RRF_K = 60


def rrf(rankings: list[list[str]], k: int = RRF_K, depth: int | None = None) -> list[tuple[str, float]]:
    """Reciprocal rank fusion (Cormack et al., 2009): score(d) = sum over lists of 1 / (k + rank(d)),
    ranks starting at 1; documents absent from a list get nothing from it. Ties keep first-seen order."""
    scores: dict[str, float] = defaultdict(float)
    for ranking in rankings:
        for rank, doc in enumerate(ranking[:depth] if depth else ranking, start=1):
            scores[doc] += 1.0 / (k + rank)
    return sorted(scores.items(), key=lambda kv: -kv[1])


def max_score(results: list[list[tuple[str, float]]]) -> list[tuple[str, float]]:
    """Max-score fusion: each document keeps its best raw score across lists (scores must be comparable)."""
    best: dict[str, float] = {}
    for ranking in results:
        for doc, score in ranking:
            if doc not in best or score > best[doc]:
                best[doc] = score
    return sorted(best.items(), key=lambda kv: -kv[1])
