"""The parts of a FAISS index that hold its search parameters (an IVF's nprobe, an HNSW's efSearch, a re-rank's
k_factor), found in the index and set on it: what a build tunes and what a reader serves with."""

from __future__ import annotations


def refine_of(index):
    """The IndexRefine (PQ codes searched, float vectors re-ranking) an index is, or None."""
    import faiss

    inner = faiss.downcast_index(index)
    return inner if isinstance(inner, faiss.IndexRefine) else None


def has_ivf(index) -> bool:
    import faiss

    try:
        faiss.extract_index_ivf(index)
        return True
    except RuntimeError:
        return False


def param_name(index) -> str | None:
    import faiss

    if has_ivf(index):
        return "nprobe"
    if isinstance(faiss.downcast_index(index), faiss.IndexHNSW):
        return "efSearch"
    return None


def set_param(index, name: str | None, value: int | None, k_factor: int | None = None) -> None:
    import faiss

    if k_factor is not None:
        refine_of(index).k_factor = float(k_factor)
    if name == "nprobe":
        faiss.extract_index_ivf(index).nprobe = int(value)
    elif name == "efSearch":
        faiss.downcast_index(index).hnsw.efSearch = int(value)
