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

import logging

import numpy as np

from imgest.retrieval.versions import previous_version
from imgest.state.committed import LIVE, load_state
from imgest.state.drift import MIN_NEW, QUANTILE, Reference, nearest, read_reference
from imgest.state.live import read_vectors
from imgest.state.models import find_model
from imgest.storage import Location, records

ALERT_SHARE = 0.25  # at least this share of the new vectors beyond the reference's 95th percentile ...
ALERT_P = 1e-3  # ... and that share this unlikely under no drift
SAMPLE = 20_000  # tonight's vectors measured at most: a seeded sample of a larger night (a model change's cold
# start is every item), drawn in SQL, so the night's vectors are never all in memory; the test's power at 20,000 is
# far past what the alert needs (a 25% share against 5%)


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
    # tonight's rows only, selected in SQL (a seeded sample of SAMPLE when there are more): the live state of a
    # large catalogue, and a large night's vectors, never come into memory
    state = load_state(store, slug)
    total = state.query("SELECT count(*) AS n FROM state WHERE status = ? AND run_id = ?", [LIVE, run_id])["n"][0]
    tonight = state.query(f"""SELECT item_id, shard FROM (SELECT item_id, shard FROM state
                              WHERE status = ? AND run_id = ? ORDER BY item_id)
                              USING SAMPLE reservoir({SAMPLE} ROWS) REPEATABLE (7)""", [LIVE, run_id]) \
        if total.as_py() > SAMPLE else \
        state.query("SELECT item_id, shard FROM state WHERE status = ? AND run_id = ? ORDER BY item_id", [LIVE, run_id])
    state.close()
    _, vectors = read_vectors(store, slug, dim, tonight)
    measured = measure(ref, vectors)
    return None if measured is None else {**measured, "tonight": total.as_py(), "trained_in": int(trained_in)}
