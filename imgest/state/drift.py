"""The drift reference of a trained index version: a base sample B of the vectors it was built on and the distance
of each vector of a disjoint probe sample A to its nearest vector in B, kept in the store beside the history."""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass

import numpy as np

from imgest.state import layout
from imgest.storage import Location, records

BASE = 4096  # vectors of B
PROBES = 1024  # vectors of A
QUANTILE = 0.95
MIN_NEW = 5  # fewer new vectors than this are not measured; a reference needs twice as many


@dataclass(frozen=True)
class Reference:
    base: np.ndarray  # (<= BASE, d) float32
    distances: np.ndarray  # (<= PROBES,) each probe's distance to its nearest base vector

    @property
    def cut(self) -> float:
        return float(np.quantile(self.distances, QUANTILE))


def nearest(base: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Euclidean distance of each query to its nearest base vector (exact)."""
    import faiss

    index = faiss.IndexFlatL2(base.shape[1])
    index.add(np.ascontiguousarray(base, np.float32))
    found, _ = index.search(np.ascontiguousarray(queries, np.float32), 1)
    return np.sqrt(np.maximum(found[:, 0], 0.0))


def reference(vectors: np.ndarray, seed: int = 0) -> Reference | None:
    """B and A drawn without overlap from the vectors an index is built on; None when there are too few."""
    n = len(vectors)
    if n < 2 * MIN_NEW:
        return None
    order = np.random.default_rng(seed).permutation(n)
    probes = min(PROBES, n // 4)
    a, b = order[:probes], order[probes:probes + BASE]
    base = np.asarray(vectors[np.sort(b)], np.float32)
    return Reference(base, nearest(base, np.asarray(vectors[np.sort(a)], np.float32)))


# -- the reference in the store, one per trained index version --------------------------------------------
def reference_key(slug: str, version: int) -> str:
    number = records.version(version, "drift version")
    return layout.drift_reference_key(slug, number)


def write_reference(store: Location, slug: str, version: int, ref: Reference) -> None:
    """Written once, beside the history (not in the immutable version folder, whose files the card lists)."""
    buffer = io.BytesIO()
    np.savez(buffer, base=ref.base.astype(np.float16), distances=ref.distances.astype(np.float32))
    store.create_exclusive(reference_key(slug, version), buffer.getvalue())


def read_reference(store: Location, slug: str, version: int, dim: int) -> Reference | None:
    """The reference of a trained version, or None when it has none (built before references were kept).
    Plain arrays only (no pickle), their shapes checked against the model before use."""
    key = reference_key(slug, version)
    if not store.exists(key):
        return None
    limit = BASE * dim * 2 + PROBES * 4 + 4096
    data = store.read_bytes(key, limit=limit + 1)
    if len(data) > limit:
        raise records.RecordError(f"{store.url}: {key}: larger than a drift reference of d={dim} can be")
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:  # sizes as stored, before anything is inflated
            if sorted(archive.namelist()) != ["base.npy", "distances.npy"] or \
                    sum(member.file_size for member in archive.infolist()) > limit:
                raise ValueError("unexpected members or sizes")
        with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
            base, distances = arrays["base"], arrays["distances"]
    except (zipfile.BadZipFile, ValueError, KeyError, OSError) as exc:
        raise records.RecordError(f"{store.url}: {key}: not a drift reference of d={dim} ({exc})") from None
    if base.ndim != 2 or base.shape[1] != dim or not 0 < len(base) <= BASE or distances.ndim != 1 \
            or not 0 < len(distances) <= PROBES or not np.isfinite(distances).all():
        raise records.RecordError(f"{store.url}: {key}: not a drift reference of d={dim}")
    return Reference(base.astype(np.float32), distances.astype(np.float32))
