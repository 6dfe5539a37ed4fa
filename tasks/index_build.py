"""Build a FAISS index from vectors, then tune its search parameter to a measured recall."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np

from tasks.index_choice import IndexChoice

EF_SEARCH = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


@dataclass
class BuildTimes:
    train_seconds: float = 0.0
    add_seconds: float = 0.0
    total_seconds: float = 0.0


@dataclass
class RecallPoint:
    param: int | None
    recall: float
    ms_per_query: float


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

    def to_dict(self) -> dict:
        return asdict(self)


GENERIC_KERNELS = ("prescott", "core2", "generic", "katmai", "atom", "nehalem")


def faiss_blas() -> dict:
    """The BLAS kernel faiss's bundled OpenBLAS picked; an old build may not know a new CPU and fall back
    to a generic kernel several times slower (OPENBLAS_CORETYPE=Haswell or SkylakeX overrides it)."""
    import faiss  # noqa: F401  (its OpenBLAS must be loaded to be listed)
    from threadpoolctl import threadpool_info

    for info in threadpool_info():
        if info.get("internal_api") == "openblas" and "faiss" in info.get("filepath", ""):
            arch = str(info.get("architecture"))
            return {"library": "openblas", "version": info.get("version"), "kernel": arch,
                    "generic": arch.lower() in GENERIC_KERNELS}
    return {"library": "unknown", "version": None, "kernel": None, "generic": False}


def warn_if_generic_blas() -> dict:
    blas = faiss_blas()
    if blas["generic"]:
        import logging

        logging.getLogger("imgest").warning(
            "faiss's bundled OpenBLAS %s runs the generic %s kernel on this CPU: training and exact search "
            "run several times slower; set OPENBLAS_CORETYPE=Haswell (or SkylakeX) for the build if the CPU has "
            "AVX2 (see BENCHMARKS.md)", blas["version"], blas["kernel"])
    return blas


def train(vectors: np.ndarray, choice: IndexChoice, seed: int = 0):
    """An empty index of `choice`, trained on a seeded sample of at most `choice.train_size` points."""
    import faiss

    n, d = vectors.shape
    index = faiss.index_factory(d, choice.factory, faiss.METRIC_INNER_PRODUCT)
    _disable_polysemous(index)
    if not index.is_trained:
        rng = np.random.default_rng(seed)
        index.train(vectors[np.sort(rng.choice(n, size=min(n, choice.train_size or n), replace=False))])
    return index


def add_in_blocks(index, vectors: np.ndarray, block: int = 65536):
    for begin in range(0, len(vectors), block):
        index.add(vectors[begin:begin + block])
    return index


def build(vectors: np.ndarray, choice: IndexChoice, seed: int = 0):
    """Train and add in this process; returns (index, times)."""
    start = time.perf_counter()
    index = train(vectors, choice, seed)
    times = BuildTimes(train_seconds=round(time.perf_counter() - start, 3))
    t0 = time.perf_counter()
    add_in_blocks(index, vectors)
    times.add_seconds = round(time.perf_counter() - t0, 3)
    times.total_seconds = round(time.perf_counter() - start, 3)
    return index, times


def mergeable(index) -> bool:
    """IVF indexes merge their inverted lists and flat indexes their codes; an HNSW graph does not merge."""
    import faiss

    return _has_ivf(index) or isinstance(faiss.downcast_index(index), faiss.IndexFlatCodes)


def part_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous, near-equal ranges of faiss ids [start, stop)."""
    bounds = np.linspace(0, n, min(parts, max(n, 1)) + 1).astype(int)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def add_part(trained: bytes, vectors: np.ndarray) -> bytes:
    """Add one contiguous slice to a copy of the trained, empty index; the filled part, serialised."""
    import faiss

    index = faiss.deserialize_index(np.frombuffer(trained, np.uint8))
    return faiss.serialize_index(add_in_blocks(index, vectors)).tobytes()


def merge_parts(trained: bytes, parts: list[tuple[int, bytes]]):
    """faiss's own merge, in id order: inverted lists of IVF parts (their ids shifted by each part's
    start), codes of flat parts; the result equals adding every vector to one index in order."""
    import faiss

    index = faiss.deserialize_index(np.frombuffer(trained, np.uint8))
    for start, data in sorted(parts, key=lambda p: p[0]):
        part = faiss.deserialize_index(np.frombuffer(data, np.uint8))
        if start != index.ntotal:
            raise ValueError(f"part starting at id {start} does not follow the {index.ntotal} ids merged so far")
        if _has_ivf(index):
            ivf = faiss.extract_index_ivf(index)
            ivf.merge_from(faiss.extract_index_ivf(part), start)
            index.ntotal = ivf.ntotal  # an IndexPreTransform (OPQ) wrapper counts on its own
        else:
            faiss.downcast_index(index).merge_from(faiss.downcast_index(part), 0)
    return index


def _disable_polysemous(index) -> None:
    # index_factory turns on polysemous training for IVF-PQ: ~5x slower to train, and we never use it.
    import faiss

    if _has_ivf(index):
        ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
        if hasattr(ivf, "do_polysemous_training"):
            ivf.do_polysemous_training = False


def _has_ivf(index) -> bool:
    import faiss

    try:
        faiss.extract_index_ivf(index)
        return True
    except RuntimeError:
        return False


def param_name(index) -> str | None:
    import faiss

    if _has_ivf(index):
        return "nprobe"
    if isinstance(faiss.downcast_index(index), faiss.IndexHNSW):
        return "efSearch"
    return None


def set_param(index, name: str | None, value: int | None) -> None:
    import faiss

    if name == "nprobe":
        faiss.extract_index_ivf(index).nprobe = int(value)
    elif name == "efSearch":
        faiss.downcast_index(index).hnsw.efSearch = int(value)


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


def tune_search(index, vectors: np.ndarray, target: float = 0.95, k: int = 10, queries: int = 1000,
                seed: int = 0) -> Tuned:
    """Sweep efSearch / nprobe upwards; serve the smallest value whose measured recall@k meets target."""
    n = len(vectors)
    k = max(1, min(k, n - 1))
    query_ids = sample_queries(n, queries, seed)
    truth_scores, _ = exact_neighbours(vectors, query_ids, k)
    name = param_name(index)
    sweep: list[RecallPoint] = []
    for value in candidates(index, name):
        set_param(index, name, value)
        t0 = time.perf_counter()
        _, ids = index.search(vectors[query_ids], k + 1)
        ms = (time.perf_counter() - t0) * 1000 / len(query_ids)
        sweep.append(RecallPoint(value, round(knn_recall(vectors, query_ids, ids, truth_scores, k), 4), round(ms, 4)))
        if sweep[-1].recall >= target:
            break
    met = [p for p in sweep if p.recall >= target]
    best = met[0] if met else max(sweep, key=lambda p: p.recall)
    set_param(index, name, best.param)
    return Tuned(name, best.param, best.recall, target, bool(met), k, len(query_ids), best.ms_per_query, sweep)
