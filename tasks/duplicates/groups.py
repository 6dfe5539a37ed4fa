"""Duplicate groups as columns: the connected components of the items that have a duplicate, over integer arrays.

Items are numbered 0..n-1 in item_id order (tasks/duplicates/scan.py). Two kinds of edge join them: equal bytes
(each item to the first item with its content hash) and the near pairs that passed (the embedding's threshold,
or the perceptual-hash rule, and the picture check where it runs). The groups are the connected components of
these edges (scipy's csgraph), of two items or more: exact when every member has the same bytes, else near.
Per group, as arrays: its size, kind, the lowest cosine of the pairs that joined it (1.0 for bytes alone) and the
signals that found them. Groups are numbered largest first, then by their first item; no Python object is made
per item or per pair.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

SIGNALS = ("embedding", "hash")  # a pair's signal: its index here; a group's signals: a bit per signal


@dataclass
class Groups:
    """Groups of the items numbered 0..n-1, as columns."""

    of_item: np.ndarray  # int32 per item: its group, or -1 when it is in none
    size: np.ndarray  # int64 per group: its members
    exact: np.ndarray  # bool per group: every member has the same bytes
    min_score: np.ndarray  # float32 per group: the lowest cosine of the pairs that joined it, 1.0 for none
    signals: np.ndarray  # uint8 per group: bit s set when a pair found by SIGNALS[s] joined it
    pair_group: np.ndarray  # int32 per pair given: the group it joined (every pair given joins one)

    def __len__(self) -> int:
        return len(self.size)


def found_by(signals: int) -> str:
    """Which signals joined a group: bytes (exact), embedding, hash, or embedding+hash."""
    names = [name for bit, name in enumerate(SIGNALS) if signals >> bit & 1]
    return "+".join(names) if names else "bytes"


def byte_edges(hash_code: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An edge from each item to the first item (by number) with the same content hash."""
    order = np.argsort(hash_code, kind="stable")
    codes = hash_code[order]
    starts = np.ones(len(codes), bool)
    starts[1:] = codes[1:] != codes[:-1]
    first = order[np.maximum.accumulate(np.where(starts, np.arange(len(codes)), 0))]
    keep = ~starts
    return order[keep], first[keep]


def group_items(hash_code: np.ndarray, a: np.ndarray, b: np.ndarray, score: np.ndarray,
                signal: np.ndarray) -> Groups:
    """Groups of two or more items. `hash_code`: per item, equal where the bytes are equal; `a`, `b`, `score`,
    `signal`: the near pairs that join (item numbers, cosine, index into SIGNALS)."""
    n = len(hash_code)
    same_a, same_b = byte_edges(hash_code)
    rows, cols = np.concatenate([same_a, a]), np.concatenate([same_b, b])
    graph = coo_matrix((np.ones(len(rows), np.int8), (rows, cols)), shape=(n, n)).tocsr()
    count, label = connected_components(graph, directed=False)
    size = np.bincount(label, minlength=count)
    first = np.full(count, n, np.int32)
    np.minimum.at(first, label, np.arange(n, dtype=np.int32))
    low, high = np.full(count, np.iinfo(np.int32).max, np.int32), np.full(count, -1, np.int32)
    np.minimum.at(low, label, hash_code)
    np.maximum.at(high, label, hash_code)
    lowest = np.ones(count, np.float32)
    np.minimum.at(lowest, label[a], np.asarray(score, np.float32))
    bits = np.zeros(count, np.uint8)
    np.bitwise_or.at(bits, label[a], (1 << np.asarray(signal, np.uint8)).astype(np.uint8))
    grouped = np.nonzero(size >= 2)[0]
    grouped = grouped[np.lexsort((first[grouped], -size[grouped]))]  # largest first, then by their first item
    number = np.full(count, -1, np.int32)
    number[grouped] = np.arange(len(grouped), dtype=np.int32)
    return Groups(of_item=number[label], size=size[grouped], exact=low[grouped] == high[grouped],
                  min_score=lowest[grouped], signals=bits[grouped], pair_group=number[label[a]])
