"""Index choice by size and budget, recall tuning on clustered data where the answer is known."""

import math

import numpy as np
import pytest

from imgest.tasks.index_build import build
from imgest.tasks.index_choice import IndexChoiceError, choose_index, nlist_for, parse_memory
from imgest.tasks.recall_tuning import knn_recall, tune_search


@pytest.mark.parametrize("text,expected", [("4G", 4 << 30), ("512M", 512 << 20), ("1.5GB", int(1.5 * (1 << 30))),
                                           ("2GiB", 2 << 30), ("1000", 1000), ("64k", 64 << 10)])
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


def test_parse_memory_rejects_nonsense():
    with pytest.raises(IndexChoiceError, match="memory must look like 4G"):
        parse_memory("lots")


@pytest.mark.parametrize("n,d,memory,factory", [
    (1_000, 512, "4G", "Flat"),
    (50_000, 512, "4G", "Flat"),
    # 1M x (4 x 512 + 2 x 32 x 4 x 1.1) = 2.33 GB of HNSW fits 4G
    (1_000_000, 512, "4G", "HNSW32,Flat"),
    # 2.33 GB does not fit 1G; SQ8: 1M x 520 + 8192 x 2048 = 537 MB does
    (1_000_000, 512, "1G", "IVF8192,SQ8"),
    # SQ8 does not fit 200M; PQ64: 1M x 72 + 16.8 MB + 1 MB = 90 MB does (OPQ only by factory string)
    (1_000_000, 512, "200M", "IVF8192,PQ64"),
    # d=1280 (Lite0): PQ64 gives 20 dims per sub-vector; nlist 32768 searches its centroids through HNSW
    (10_000_000, 1280, "2G", "IVF32768_HNSW32,PQ64"),
    # 5M x 264 + 16384 x 1024 + the centroids' graph = 1.34 GB of SQ8 fits 2G; nlist 16384: HNSW coarse
    (5_000_000, 256, "2G", "IVF16384_HNSW32,SQ8"),
    (3_000_000, 256, "2G", "IVF16384_HNSW32,SQ8"),
    (2_000_000, 256, "1G", "IVF8192,SQ8"),
])
def test_choice_by_size_and_budget(n, d, memory, factory):
    assert choose_index(n, d, memory).factory == factory


def test_explicit_kind_and_factory_override_the_rule():
    assert choose_index(1_000, 64, "4G", "hnsw").factory == "HNSW32,Flat"
    assert choose_index(1_000_000, 512, "64G", "ivfpq").factory == "IVF8192,PQ64"
    assert choose_index(1_000_000, 512, "4G", "OPQ64_512,IVF8192,PQ64").kind == "factory"
    assert choose_index(5_000, 64, "4G", "IVF64,Flat").factory == "IVF64,Flat"
    with pytest.raises(IndexChoiceError, match="unknown index kind 'annoy'; allowed: auto, flat, hnsw"):
        choose_index(10, 8, "4G", "annoy")


def test_budget_too_small_says_what_is_needed():
    with pytest.raises(IndexChoiceError, match=r"too small for 1000000 vectors of d=512: the smallest index"):
        choose_index(1_000_000, 512, "10M")


@pytest.mark.parametrize("n", [100_000, 1_000_000, 50_000_000])
def test_nlist_band_and_training_points(n):
    nlist = nlist_for(n)
    assert 4 * math.sqrt(n) <= nlist <= 16 * math.sqrt(n)
    assert n >= 39 * nlist


@pytest.mark.parametrize("n,nlist", [(10_000, 256), (2_000, 32), (50, 1)])
def test_nlist_shrinks_below_the_band_to_keep_39_points_per_centroid(n, nlist):
    # 10,000: 8 x sqrt(N) = 800 -> 1024, but 39 x 1024 > 10,000; halving stops at 256 (39 x 256 = 9,984)
    assert nlist_for(n) == nlist


def clustered(n=6_000, d=32, clusters=60, noise=0.35, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, d)).astype(np.float32)
    x = centres[rng.integers(0, clusters, n)] + noise * rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_recall_ties_are_tolerated():
    # three identical vectors: the exact top-1 of vector 0 (excluding itself) is 1 or 2, both correct
    vectors = np.array([[1, 0], [1, 0], [1, 0], [0, 1]], np.float32)
    truth_scores = np.array([[1.0]], np.float32)
    assert knn_recall(vectors, np.array([0]), np.array([[0, 2]]), truth_scores, k=1) == 1.0
    assert knn_recall(vectors, np.array([0]), np.array([[3]]), truth_scores, k=1) == 0.0


@pytest.mark.parametrize("kind", ["hnsw", "ivfsq8"])
def test_tuning_serves_the_smallest_parameter_meeting_the_target(kind):
    x = clustered()
    index, times = build(x, choose_index(len(x), x.shape[1], "4G", kind))
    assert index.ntotal == len(x) and times.total_seconds >= times.add_seconds
    tuned = tune_search(index, x, target=0.95, k=10, queries=300)
    assert tuned.met and tuned.recall >= 0.95
    assert tuned.param == tuned.sweep[-1].param
    assert all(p.recall < 0.95 for p in tuned.sweep[:-1]), "a smaller value would have met the target"


def test_an_hnsw_coarse_quantizer_builds_tunes_and_merges():
    """The factory the rule picks from nlist 16,384, at a size a test can build: trains, tunes nprobe to the
    target, and parts added separately merge into the same index."""
    import faiss

    from imgest.tasks.index_build import add_part, merge_parts

    x = clustered()
    choice = choose_index(len(x), x.shape[1], "4G", "IVF64_HNSW32,SQ8")
    index, _ = build(x, choice)
    tuned = tune_search(index, x, target=0.95, k=10, queries=300)
    assert tuned.met and tuned.param_name == "nprobe"
    one = faiss.index_factory(x.shape[1], "IVF64_HNSW32,SQ8", faiss.METRIC_INNER_PRODUCT)
    one.train(x[:2000])
    trained = faiss.serialize_index(one).tobytes()
    half = len(x) // 2
    merged = merge_parts(trained, [(0, add_part(trained, x[:half])), (half, add_part(trained, x[half:]))])
    one.add(x)
    faiss.extract_index_ivf(one).nprobe = faiss.extract_index_ivf(merged).nprobe = 8
    assert (one.search(x[:50], 10)[1] == merged.search(x[:50], 10)[1]).all()


def test_flat_is_exact():
    x = clustered(n=1_000)
    index, _ = build(x, choose_index(len(x), x.shape[1]))
    tuned = tune_search(index, x, target=0.99, k=10, queries=200)
    assert tuned.param_name is None and tuned.recall == 1.0


def test_unmet_target_is_reported_not_hidden():
    x = clustered(n=4_000, d=32, noise=0.6)
    index, _ = build(x, choose_index(len(x), 32, "4G", "IVF16,PQ4"))  # 4 bytes per vector cannot reach 0.999
    tuned = tune_search(index, x, target=0.999, k=10, queries=200)
    assert not tuned.met and tuned.recall < 0.999
    assert tuned.recall == max(p.recall for p in tuned.sweep)  # serves the best it found
