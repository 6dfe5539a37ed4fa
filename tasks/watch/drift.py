"""Drift of new images: how far new embeddings sit from the data an index was built on, against how far that
data sits from itself.

A reference is taken from the vectors an index version is built on: a base sample B and a probe sample A,
disjoint, and the distance of each probe to its nearest vector in B. A night's new vectors are measured the
same way, to their nearest vector in B. Drawn from the same distribution, a new vector lands beyond the
reference's 95th percentile with probability 0.05; the score is the share that does, and a one-sided
binomial test says how unlikely that share is under no drift. Both sides are distances to the same B, so a
small B makes both larger alike: the comparison stays fair at any sample size.
"""

from __future__ import annotations

import io
import logging
import zipfile
from dataclasses import dataclass

import numpy as np

from imgest import records
from imgest.storage import Location
from imgest.tasks.index.store import previous_version
from imgest.tasks.index.update import read_vectors
from imgest.tasks.state.committed import LIVE, load_state
from imgest.tasks.state.models import find_model

BASE = 4096  # vectors of B
PROBES = 1024  # vectors of A
QUANTILE = 0.95
ALERT_SHARE = 0.25  # at least this share of the new vectors beyond the reference's 95th percentile ...
ALERT_P = 1e-3  # ... and that share this unlikely under no drift
MIN_NEW = 5


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


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    from scipy.stats import binom

    return float(binom.sf(k - 1, n, p))


def measure(ref: Reference, new: np.ndarray) -> dict | None:
    """The drift of `new` against `ref`: the share beyond the reference's cut, its p-value, the median distance
    ratio; `high` when it passes both alert thresholds. None for fewer than MIN_NEW new vectors."""
    if len(new) < MIN_NEW:
        return None
    distances = nearest(ref.base, new)
    beyond = int((distances > ref.cut).sum())
    p_value = binomial_tail(beyond, len(new), 1 - QUANTILE)
    share = beyond / len(new)
    return {"score": round(share, 4), "new": len(new), "beyond": beyond, "p_value": float(f"{p_value:.3g}"),
            "median_ratio": round(float(np.median(distances) / max(np.median(ref.distances), 1e-12)), 4),
            "cut": round(ref.cut, 6), "reference": {"base": len(ref.base), "probes": len(ref.distances)},
            "high": share >= ALERT_SHARE and p_value < ALERT_P}


# -- the reference in the store, one per trained index version --------------------------------------------
def reference_key(slug: str, version: int) -> str:
    number = records.version(version, "drift version")
    return f"history/drift/model={records.slug(slug, 'drift model')}/v{number:04d}.npz"


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


def night_drift(store: Location, slug: str, run_id: str) -> dict | None:
    """Tonight's new and changed vectors of a model against the reference of the version serving before
    tonight's build (of the version that trained it, when it was updated in place since). None when there is
    nothing to judge: no earlier version, a version without a reference, too few new images, or a reference
    that does not read as one (a warning names it; the night goes on without a drift figure)."""
    serving = previous_version(store, slug)
    if serving is None:
        return None
    trained_in = (serving.get("lineage") or {}).get("trained_in") or serving["version"]
    dim = int(find_model(store, slug)["dim"])
    try:
        ref = read_reference(store, slug, int(trained_in), dim)
    except records.RecordError as exc:
        logging.getLogger("imgest").warning("drift: no measurement tonight: %s", exc)
        return None
    if ref is None:
        return None
    # tonight's rows only, selected in SQL: the live state of a large catalogue never comes into memory
    state = load_state(store, slug)
    tonight = state.query("SELECT item_id, shard FROM state WHERE status = ? AND run_id = ? ORDER BY item_id",
                          [LIVE, run_id])
    state.close()
    _, vectors = read_vectors(store, slug, dim, tonight)
    measured = measure(ref, vectors)
    return None if measured is None else {**measured, "trained_in": int(trained_in)}
