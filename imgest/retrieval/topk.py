"""The k best of ranked result blocks merged as they arrive (an exact scan in blocks keeps only these)."""

from __future__ import annotations

import numpy as np


def keep_best(scores: np.ndarray, values: np.ndarray, more_scores: np.ndarray, more_values: np.ndarray, k: int):
    """Each row's `k` best (highest score, earlier first on ties) of what it had and what came: (scores, values)."""
    scores, values = np.concatenate([scores, more_scores], axis=1), np.concatenate([values, more_values], axis=1)
    best = np.argsort(-scores, axis=1, kind="stable")[:, :min(k, scores.shape[1])]
    return np.take_along_axis(scores, best, 1), np.take_along_axis(values, best, 1)
