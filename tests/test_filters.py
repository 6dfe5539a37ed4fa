"""--where and --group-by: DuckDB predicates to id sets (no file access, one statement), faiss ID-selector
search that is never under-filled on Flat, HNSW and IVF indexes, and grouping by a metadata column."""

from __future__ import annotations

import faiss
import numpy as np
import pyarrow as pa
import pytest

from imgest.retrieval.filters import FilterError, filtered_search, grouped, matching_items, positions
from imgest.retrieval.query import Hit
from imgest.tasks.index.build import new_index

TABLE = pa.table({"item_id": ["a", "b", "c", "d"], "category": ["shoes", "shoes", "coats", None],
                  "price": [39.5, 80.0, 120.0, 10.0], "row_hash": ["1", "2", "3", "4"]})


def test_a_predicate_selects_items():
    assert matching_items(TABLE, "category = 'shoes' AND price < 50").to_pylist() == ["a"]
    assert sorted(matching_items(TABLE, "price < 100 OR category IS NULL").to_pylist()) == ["a", "b", "d"]
    assert matching_items(TABLE, "category = 'x;y'").to_pylist() == []  # a ';' in a literal is data
    assert positions(matching_items(TABLE, "price > 50"), pa.array(["c", "x", "b"])).tolist() == [2, 0]


@pytest.mark.parametrize("where, message", [
    ("colour = 'red'", r"colour.*columns: item_id, category, price"),
    ("price <", r"--where 'price <'"),
    ("1=1); DROP TABLE metadata; SELECT (1", r"one predicate over the metadata's columns, not statements"),
    ("EXISTS (SELECT * FROM read_csv('/etc/passwd'))", r"a subquery is not allowed"),  # more: test_where_limits
])
def test_bad_predicates_are_one_clear_error(where, message):
    with pytest.raises(FilterError, match=message):
        matching_items(TABLE, where)


def _vectors(n=3000, d=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("factory, param, value", [("Flat", None, None), ("HNSW16", "efSearch", 16),
                                                   ("IVF64,Flat", "nprobe", 1), ("IVF64,PQ8x4fs", "nprobe", 1),
                                                   ("IVF64,PQ8,Refine(SQfp16)", "nprobe", 1),
                                                   ("OPQ8_32,IVF64,PQ8,Refine(SQfp16)", "nprobe", 1)])
def test_a_selective_filter_is_never_under_filled(factory, param, value):
    x = _vectors()
    index = new_index(x.shape[1], factory)  # as imgest trains them: polysemous training off, OPQ bounded
    index.train(x)
    index.add(x)
    if param == "efSearch":
        faiss.downcast_index(index).hnsw.efSearch = value
    elif param == "nprobe":
        faiss.extract_index_ivf(index).nprobe = value
    rng = np.random.default_rng(1)
    allowed = np.sort(rng.choice(len(x), size=25, replace=False))  # under 1%: the served parameters miss most
    queries = _vectors(8, seed=2)
    k_factor = 4 if "Refine" in factory else None
    scores, ids = filtered_search(index, queries, 10, allowed, param, value, k_factor)
    assert (ids >= 0).all() and np.isin(ids, allowed).all()  # k results, all satisfying the filter
    exact = np.argsort(-(queries @ x[allowed].T), axis=1)[:, :10]
    if factory in ("Flat", "HNSW16"):  # flat storage: the exact top 10 of the selected items
        assert (np.sort(ids, axis=1) == np.sort(allowed[exact], axis=1)).all()
    few = filtered_search(index, queries, 10, allowed[:3], param, value, k_factor)[1]
    assert ((few >= 0).sum(axis=1) == 3).all() and (few[:, 3:] == -1).all()  # fewer exist: all of them


def test_grouping_keeps_the_best_hits_of_each_group():
    hits = [Hit(n + 1, f"i{n}", f"file:///i{n}", 1.0 - n / 10) for n in range(8)]
    product = {"i0": "p1", "i1": "p1", "i2": "p2", "i3": "p1", "i4": "p3", "i6": "p4"}
    kept, full = grouped(hits, product, k=3, per_group=1)
    assert [(h.item_id, h.group, h.rank) for h in kept] == [("i0", "p1", 1), ("i2", "p2", 2), ("i4", "p3", 3)]
    assert full
    kept, full = grouped([Hit(n + 1, f"i{n}", "", 0.0) for n in range(8)], product, k=3, per_group=2)
    assert [h.item_id for h in kept] == ["i0", "i1", "i2", "i4"] and full
    kept, full = grouped(hits[:2], product, k=3, per_group=1)
    assert [h.item_id for h in kept] == ["i0"] and not full
