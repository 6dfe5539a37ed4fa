"""Index choice by size and budget, recall tuning on clustered data where the answer is known."""

import math

import numpy as np
import pytest

from imgest.names import SizeError, parse_memory
from imgest.tasks.index.build import build
from imgest.tasks.index.choice import (
    HNSW_NIGHTLY_MAX_N,
    IndexChoiceError,
    choose_index,
    kept_fallback,
    nightly_fallback,
    nlist_for,
)
from imgest.tasks.index.tuning import knn_recall, tune_search


@pytest.mark.parametrize("text,expected", [("4G", 4 << 30), ("512M", 512 << 20), ("1.5GB", int(1.5 * (1 << 30))),
                                           ("2GiB", 2 << 30), ("1000", 1000), ("64k", 64 << 10)])
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


def test_parse_memory_rejects_nonsense():
    with pytest.raises(SizeError, match="memory must look like 4G"):
        parse_memory("lots")


@pytest.mark.parametrize("n,d,memory,factory", [
    (1_000, 512, "4G", "Flat"),
    (50_000, 512, "4G", "Flat"),
    # 100k x (4 x 512 + 2 x 32 x 4 x 1.1) = 0.23 GB of HNSW fits 4G
    (100_000, 512, "4G", "HNSW32,Flat"),
    # 1M: 2.33 GB of HNSW fits 4G too, but past 100k a nightly would build the graph again every night: SQ8,
    # 1M x 520 + 8192 x 2048 = 537 MB, which it updates in place
    (1_000_000, 512, "4G", "IVF8192,SQ8"),
    # 2.33 GB does not fit 1G; SQ8: 1M x 520 + 8192 x 2048 = 537 MB does
    (1_000_000, 512, "1G", "IVF8192,SQ8"),
    # SQ8 does not fit 200M; PQ128 codes: 1M x 136 + 16.8 MB coarse + 0.5 MB codebooks = 153 MB do (PQ256 would
    # leave 2 dims per sub-vector); the float16 vectors (1 GB) go to disk, which is unlimited by default
    (1_000_000, 512, "200M", "IVF8192,PQ128,Refine(SQfp16)"),
    # 1/16 of fp32 (128 MB): PQ64 codes, 1M x 72 + 17.3 MB = 89 MB
    (1_000_000, 512, "128M", "IVF8192,PQ64,Refine(SQfp16)"),
    # d=1280 (Lite0) at 2G: PQ160 (8 dims each): 10M x 168 + 131 MB of centroids + their graph = 1.83 GB; nlist
    # 25600 (8 x sqrt(N) = 25,298 to a multiple of 1,024) searches its centroids through HNSW
    (10_000_000, 1280, "2G", "IVF25600_HNSW32,PQ160,Refine(SQfp16)"),
    # at 1G only PQ80 fits (16 dims per sub-vector): an OPQ rotation first
    (10_000_000, 1280, "1G", "OPQ80_1280,IVF25600_HNSW32,PQ80,Refine(SQfp16)"),
    # 10k Lite0 vectors at 1/16 of fp32 (3.2 MB): PQ32 codes (0.4 MB), centroids and codebooks (2.6 MB) fit; the
    # 6.5 MB OPQ rotation its 40-dim sub-vectors would get does not, so none
    (10_018, 1280, 3_205_760, "IVF256,PQ32,Refine(SQfp16)"),
    # 5M x 264 + 17408 x 1024 + the centroids' graph = 1.34 GB of SQ8 fits 2G; nlist 17408: HNSW coarse
    (5_000_000, 256, "2G", "IVF17408_HNSW32,SQ8"),
    (4_000_000, 256, "2G", "IVF16384_HNSW32,SQ8"),
    (3_000_000, 256, "2G", "IVF14336,SQ8"),  # under 16,384 lists the centroids are scanned
    (2_000_000, 256, "1G", "IVF11264,SQ8"),
])
def test_choice_by_size_and_budget(n, d, memory, factory):
    assert choose_index(n, d, memory).factory == factory


def test_past_the_measured_size_auto_keeps_an_index_the_nightly_can_update():
    """HNSW fits 4G at both sizes; past HNSW_NIGHTLY_MAX_N the rule takes IVF,SQ8, which the nightly updates in
    place, and says so; HNSW is what it falls back to."""
    small, large = choose_index(HNSW_NIGHTLY_MAX_N, 1280, "4G"), choose_index(HNSW_NIGHTLY_MAX_N + 1, 1280, "4G")
    assert small.kind == "hnsw" and small.instead_of is None
    assert large.kind == "ivfsq8" and large.instead_of == "hnsw"
    assert f"past N={HNSW_NIGHTLY_MAX_N:,}" in large.reason and "updates it" in large.reason
    assert choose_index(HNSW_NIGHTLY_MAX_N + 1, 1280, "4G", "hnsw").kind == "hnsw", "asked for: no rule applies"
    assert choose_index(HNSW_NIGHTLY_MAX_N + 1, 1280, "4G", "ivfsq8").instead_of is None

    back = nightly_fallback(large, large_n := HNSW_NIGHTLY_MAX_N + 1, 1280, "4G", None, 0.91, 0.95)
    assert back.kind == "hnsw" and back.missed_at_n == large_n and "reached recall 0.91 < target 0.95" in back.reason
    previous = {"version": 3, "choice": back.to_dict()}
    kept = kept_fallback(previous, large_n + 10, 1280, "4G", None)
    assert kept.kind == "hnsw" and kept.missed_at_n == large_n and "v0003 fell back to hnsw" in kept.reason
    assert kept_fallback(previous, 2 * large_n, 1280, "4G", None) is None, "the catalogue doubled: IVF again"
    assert kept_fallback({"version": 2, "choice": large.to_dict()}, large_n, 1280, "4G", None) is None


def test_explicit_kind_and_factory_override_the_rule():
    assert choose_index(1_000, 64, "4G", "hnsw").factory == "HNSW32,Flat"
    assert choose_index(1_000_000, 512, "64G", "ivfpq").factory == "IVF8192,PQ64,Refine(SQfp16)"
    assert choose_index(1_000_000, 512, "4G", "OPQ64_512,IVF8192,PQ64").kind == "factory"
    assert choose_index(5_000, 64, "4G", "IVF64,Flat").factory == "IVF64,Flat"
    with pytest.raises(IndexChoiceError, match="unknown index kind 'annoy'; allowed: auto, flat, hnsw"):
        choose_index(10, 8, "4G", "annoy")


def test_budget_too_small_says_what_is_needed():
    with pytest.raises(IndexChoiceError, match=r"too small for 1000000 vectors of d=512: the smallest index"):
        choose_index(1_000_000, 512, "10M")


@pytest.mark.parametrize("n", [100_000, 1_000_000, 10_000_000, 50_000_000, 100_000_000])
def test_nlist_band_and_training_points(n):
    nlist = nlist_for(n)
    assert 4 * math.sqrt(n) <= nlist <= 16 * math.sqrt(n)
    assert n >= 39 * nlist
    if n >= 1_000_000:  # k-means costs nlist^2: within 4% of 8 x sqrt(N), its training stays linear in N
        assert nlist % 1024 == 0 and abs(nlist / (8 * math.sqrt(n)) - 1) < 0.04


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

    from imgest.tasks.index.build import add_part, merge_parts

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


def test_pq_with_a_re_rank_meets_the_target_that_pq_alone_misses():
    """8 bytes of PQ per 64-d vector plateau far below 0.95; the same codes searched for k x k_factor candidates
    re-scored by float16 vectors meet it, and the sweep serves the fastest (nprobe, k_factor) that does."""
    from imgest.retrieval.params import refine_of

    x = clustered(n=8_000, d=64, clusters=80, noise=0.6)
    alone, _ = build(x, choose_index(len(x), 64, "4G", "IVF32,PQ8"))
    plain = tune_search(alone, x, target=0.95, k=10, queries=300)
    assert not plain.met and plain.recall < 0.8
    index, _ = build(x, choose_index(len(x), 64, "4G", "IVF32,PQ8,Refine(SQfp16)"))
    tuned = tune_search(index, x, target=0.95, k=10, queries=300)
    assert tuned.met and tuned.k_factor > 1 and refine_of(index).k_factor == tuned.k_factor
    assert {p.k_factor for p in tuned.sweep} >= {1, tuned.k_factor}
    served = next(p for p in tuned.sweep if (p.param, p.k_factor) == (tuned.param, tuned.k_factor))
    assert served.recall >= 0.95 and faiss_nprobe(index) == tuned.param
    assert all(p.ms_per_query >= served.ms_per_query for p in tuned.sweep if p.recall >= 0.95)


def faiss_nprobe(index) -> int:
    import faiss

    return faiss.extract_index_ivf(index).nprobe


@pytest.mark.parametrize("factory", ["IVF32,PQ16,Refine(SQfp16)", "OPQ8_64,IVF32,PQ8,Refine(SQfp16)"])
def test_the_memory_estimate_matches_the_built_index(factory):
    """RAM: codes and ids, coarse centroids, codebooks (and the OPQ rotation), checked against the built index;
    disk: the float16 vectors, exactly 2d bytes each."""
    from imgest.tasks.index.card import footprint
    from imgest.tasks.index.choice import IndexChoice, pq_bytes, refine_bytes

    x = clustered(n=6_000, d=64)
    m, opq = int(factory.split(",PQ")[1].split(",")[0]), factory.startswith("OPQ")
    choice = IndexChoice(factory, "ivfpq", 32, m, 6_000, pq_bytes(len(x), 64, 32, m, opq), "test", "disk",
                         refine_bytes(len(x), 64))
    index, _ = build(x, choice)
    measured = footprint(index, choice)
    assert measured["disk_bytes"] == len(x) * 2 * 64 == choice.disk_bytes
    assert abs(measured["ram_bytes"] - choice.estimated_bytes) < 0.1 * choice.estimated_bytes, measured


def test_the_disk_budget_decides_where_the_re_rank_vectors_go():
    on_disk = choose_index(1_000_000, 512, "128M")
    assert on_disk.refine == "disk" and on_disk.disk_bytes == 1_000_000 * 1024 and "Refine(SQfp16)" in on_disk.factory
    in_ram = choose_index(1_000_000, 512, "2G", "ivfpq", disk="512M")
    assert in_ram.refine == "ram" and in_ram.disk_bytes == 0 and in_ram.estimated_bytes > 1_000_000 * 1024
    none = choose_index(1_000_000, 512, "128M", disk="0")
    assert none.refine is None and none.factory == "IVF8192,PQ64" and "no re-rank" in none.reason
