"""IVF codes added once every list's length is known (tasks/index/lists.py): the same index as adding block by
block, in about its entries' bytes where block-by-block growth leaves the lists holding far more."""


import faiss
import numpy as np
import pytest

from imgest.tasks.index.build import new_index
from imgest.tasks.index.lists import SizedAdd
from tests.helpers import heap_in_use

D, N, BLOCK = 16, 60_000, 4096


def trained(factory: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    index = new_index(D, factory)  # as imgest trains them: polysemous training off, OPQ bounded
    index.train(rng.standard_normal((20_000, D), dtype=np.float32))
    return index


def blocks(seed: int = 1):
    rng = np.random.default_rng(seed)
    for begin in range(0, N, BLOCK):
        rows = min(BLOCK, N - begin)
        yield rng.standard_normal((rows, D), dtype=np.float32), rng.permutation(rows).astype(np.int64) + begin


@pytest.mark.parametrize("factory", ["IVF64,SQ8", "IVF64_HNSW8,SQ8", "OPQ4_16,IVF64,PQ4", "IVF64,Flat",
                                     "IVF64,PQ8x4fs"])
def test_sized_lists_hold_the_same_index_as_adding_block_by_block(factory):
    grown = trained(factory)
    adder = SizedAdd(faiss.clone_index(grown))  # the same training (OPQ's took most of the test, done twice)
    for vectors, ids in blocks():
        grown.add_with_ids(vectors, ids)
        adder.add(vectors, ids)
    index = adder.fill()
    assert index.ntotal == grown.ntotal == N
    faiss.extract_index_ivf(index).nprobe = faiss.extract_index_ivf(grown).nprobe = 8
    queries = np.random.default_rng(2).standard_normal((50, D), dtype=np.float32)
    scores, found = index.search(queries, 10)
    expected_scores, expected = grown.search(queries, 10)
    np.testing.assert_array_equal(found, expected)
    np.testing.assert_array_equal(scores, expected_scores)


def test_sized_lists_take_their_entries_bytes_where_growing_lists_take_far_more():
    entry = 8 + D  # an SQ8 code and its id
    grown = trained("IVF256,SQ8")
    before = heap_in_use()
    for vectors, ids in blocks():
        grown.add_with_ids(vectors, ids)
    growth = heap_in_use() - before
    del grown

    sized = trained("IVF256,SQ8")
    adder = SizedAdd(sized)
    for vectors, ids in blocks():
        adder.add(vectors, ids)
    before = heap_in_use()
    adder.fill()
    filled = heap_in_use() - before
    assert growth > 1.25 * N * entry, f"lists grown block by block: {growth / (N * entry):.2f}x their entries"
    assert filled < 1.05 * N * entry, f"lists sized first: {filled / (N * entry):.2f}x their entries"
