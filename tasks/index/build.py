"""Build a FAISS index from vectors: train on a sample, add in blocks, or add parts in parallel and merge."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from imgest.retrieval.params import has_ivf, refine_of
from imgest.tasks.index.choice import OPQ_NITER, OPQ_TRAIN, IndexChoice
from imgest.timing import Stopwatch


@dataclass
class BuildTimes:
    train_seconds: float = 0.0
    add_seconds: float = 0.0
    total_seconds: float = 0.0


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


def train(vectors: np.ndarray, choice: IndexChoice, seed: int = 0, rows: np.ndarray | None = None):
    """An empty index of `choice`, trained on `rows` of `vectors` (default: a seeded sample of at most
    `choice.train_size` of them)."""
    n, d = vectors.shape
    index = new_index(d, choice.factory)
    if not index.is_trained:
        if rows is None:
            rng = np.random.default_rng(seed)
            rows = np.sort(rng.choice(n, size=min(n, choice.train_size or n), replace=False))
        whole = len(rows) == n and bool((rows == np.arange(n)).all())  # every row in order: no copy needed
        index.train(np.ascontiguousarray(vectors if whole else vectors[rows]))
    return index


def new_index(d: int, factory: str):
    """An empty inner-product index of `factory` as imgest trains them: polysemous training off, OPQ's training
    bounded."""
    import faiss

    index = faiss.index_factory(d, factory, faiss.METRIC_INNER_PRODUCT)
    _disable_polysemous(index)
    _bound_opq(index)
    return index


def add_in_blocks(index, vectors: np.ndarray, block: int = 65536, on_added: Callable[[int], None] | None = None):
    """Add in blocks (bounded temporaries); `on_added(n)` after each block, n vectors added so far."""
    for begin in range(0, len(vectors), block):
        index.add(vectors[begin:begin + block])
        if on_added is not None:
            on_added(min(begin + block, len(vectors)))
    return index


def build(vectors: np.ndarray, choice: IndexChoice, seed: int = 0, on_added: Callable[[int], None] | None = None,
          rows: np.ndarray | None = None):
    """Train (on `rows`, default a seeded sample) and add in this process; returns (index, times)."""
    total = Stopwatch()
    with Stopwatch() as training:
        index = train(vectors, choice, seed, rows)
    with Stopwatch() as adding:
        add_in_blocks(index, vectors, on_added=on_added)
    times = BuildTimes(training.seconds, adding.seconds, total.seconds)
    return index, times


def mergeable(index) -> bool:
    """IVF indexes merge their inverted lists and flat indexes their codes; an HNSW graph does not merge."""
    import faiss

    if refine_of(index) is not None:  # its re-rank vectors are a second index, numbered by add order
        return False
    return has_ivf(index) or isinstance(faiss.downcast_index(index), faiss.IndexFlatCodes)


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
        if has_ivf(index):
            ivf = faiss.extract_index_ivf(index)
            ivf.merge_from(faiss.extract_index_ivf(part), start)
            index.ntotal = ivf.ntotal  # an IndexPreTransform (OPQ) wrapper counts on its own
        else:
            faiss.downcast_index(index).merge_from(faiss.downcast_index(part), 0)
    return index


def _disable_polysemous(index) -> None:
    # index_factory turns on polysemous training for IVF-PQ: ~5x slower to train, and we never use it.
    import faiss

    if has_ivf(index):
        ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
        if hasattr(ivf, "do_polysemous_training"):
            ivf.do_polysemous_training = False


def _bound_opq(index) -> None:
    # an OPQ rotation trains on at most OPQ_TRAIN vectors for OPQ_NITER iterations (see index_choice)
    import faiss

    refine = refine_of(index)
    inner = faiss.downcast_index(refine.base_index if refine is not None else index)
    if isinstance(inner, faiss.IndexPreTransform):
        for i in range(inner.chain.size()):
            transform = faiss.downcast_VectorTransform(inner.chain.at(i))
            if isinstance(transform, faiss.OPQMatrix):
                transform.niter, transform.max_train_points = OPQ_NITER, OPQ_TRAIN
