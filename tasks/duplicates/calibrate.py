"""The near-duplicate threshold of one model on one catalogue, measured on the catalogue itself.

A seeded sample of live images is copied the ways a catalogue copies images (tasks/duplicates/variants.py)
and the copies are embedded by the model. Two score distributions follow:

  planted  cosine(original, a copy of it)              - what a duplicate scores
  other    cosine(original, its nearest other item)    - what a different item scores, at worst

The threshold is the highest score that still finds `target_recall` of the planted copies of each kind (the
catalogue's own mix of kinds is unknown). Precision is
measured against the nearest-other pairs, each class weighted alike:

  recall(t)    = share of planted pairs scoring >= t
  false(t)     = share of nearest-other pairs scoring >= t
  precision(t) = recall(t) / (recall(t) + false(t))

When precision at that threshold is under `min_precision` (the model scores some different items as high as
copies), the threshold rises until precision holds, and recall falls. If it falls under the target, the
embedding is weak for this catalogue and a second signal joins it: a pair among an item's nearest neighbours
scoring at least `floor` (the score 99% of planted copies reach) is a duplicate when the perceptual hashes of
the two decoded images are within `hash_distance` bits, the largest distance at which precision still holds.

A nearest other item that is the same picture (a copy the catalogue already holds: perceptual hashes within
SAME_PICTURE bits, or one picture found inside the other by tasks/duplicates/verify.py) is not counted as a
different item; the next neighbour is taken. A copy neither check sees still counts against precision, so the
figure errs low.

Record (create-only, newest wins): duplicates/calibration/model=<slug>/<created>.json
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa

from imgest.images.decode import DecodeError
from imgest.state.layout import calibration_prefix
from imgest.storage import Location, RecordError, StorageError
from imgest.tasks.duplicates.hashes import hamming, perceptual_hash, picture
from imgest.tasks.duplicates.variants import KINDS, make_variant
from imgest.tasks.duplicates.verify import same_picture

SAMPLE = 100  # originals drawn by default; each gets one copy of every kind
MIN_SAMPLE = 8  # fewer readable originals than this: no calibration (the figures would mean nothing)
TARGET_RECALL = 0.95
MIN_PRECISION = 0.99
SAME_PICTURE = 4  # hash bits within which a nearest other item is a copy the catalogue already holds
MAX_HASH_DISTANCE = 16  # the hash signal never accepts pairs further apart than this (of 64 bits)
EMBED_BATCH = 48  # copies embedded together
NEIGHBOURS = 8  # nearest items looked at for each original's nearest *other* one
STALE_SHARE = 0.2  # the calibration is redone when the live count moved by this share, or the sample lost it


@dataclass
class Calibration:
    """What was measured and chosen, with what made it (model, sample, seed)."""

    slug: str
    model_id: str
    created: str
    seed: int
    items: int  # live items when it was measured
    sample: list[str]  # the originals' item_ids
    sample_hashes: list[str]  # their content hashes (a changed image makes the sample stale)
    kinds: list[str]
    target_recall: float
    min_precision: float
    threshold: float
    recall: float
    precision: float
    planted: list[float] = field(repr=False)  # every planted pair's cosine
    planted_hash: list[int] = field(repr=False)  # its hash distance
    other: list[float] = field(repr=False)  # every nearest-other pair's cosine
    other_hash: list[int] = field(repr=False)
    catalogue_copies: int = 0  # nearest items skipped as copies the catalogue holds
    unreadable: int = 0  # sampled originals that could not be read or decoded (skipped)
    hash_signal: dict | None = None  # {"floor", "hash_distance", "recall", "precision"} when the embedding is weak
    recall_by_kind: dict[str, float] = field(default_factory=dict)  # the embedding's recall of each kind of copy
    confirmed: float = 1.0  # share of the planted copies the picture check (verify.py) confirms

    def summary(self) -> dict:
        """The figures a report shows (no score lists)."""
        return {"recall": self.recall, "precision": self.precision, "sample": len(self.sample),
                "planted_pairs": len(self.planted), "other_pairs": len(self.other), "seed": self.seed,
                "target_recall": self.target_recall, "min_precision": self.min_precision, "created": self.created,
                "model_id": self.model_id, "recall_by_kind": self.recall_by_kind, "confirmed": self.confirmed,
                "catalogue_copies": self.catalogue_copies, "hash_signal": self.hash_signal}

    def at(self, threshold: float) -> dict:
        """Recall and precision of the embedding alone at another threshold (an operator's --threshold)."""
        planted = np.asarray(self.planted)
        recall, precision = _rates(planted, np.asarray(self.other), threshold)
        return {**self.summary(), "recall": recall, "precision": precision, "hash_signal": None,
                "recall_by_kind": by_kind(planted, self.kinds, threshold)}


def _rates(planted: np.ndarray, other: np.ndarray, threshold: float,
           planted_found: np.ndarray | None = None, other_found: np.ndarray | None = None) -> tuple[float, float]:
    found = planted >= threshold if planted_found is None else planted_found
    false = other >= threshold if other_found is None else other_found
    recall = float(found.mean()) if len(found) else 0.0
    false_rate = float(false.mean()) if len(false) else 0.0
    precision = recall / (recall + false_rate) if recall + false_rate > 0 else 1.0
    return round(recall, 4), round(precision, 4)


def by_kind(planted: np.ndarray, kinds: list[str], threshold: float) -> dict[str, float]:
    rows = planted.reshape(-1, len(kinds))
    return {kind: round(float((rows[:, k] >= threshold).mean()), 4) for k, kind in enumerate(kinds)}


def _above(score: float) -> float:
    """The threshold just above a score, on the 1e-4 grid reports print (so the printed value is exact)."""
    return min(1.0, math.floor(score * 1e4 + 1) / 1e4)


def _at_or_below(score: float) -> float:
    return math.floor(score * 1e4) / 1e4


def choose_threshold(planted: np.ndarray, other: np.ndarray, target_recall: float, min_precision: float,
                     kinds: int = 1) -> float:
    """The highest threshold finding `target_recall` of the planted pairs of each kind (`planted` holds one
    pair of every kind per original, in turn: a catalogue's mix of copies is unknown, so no kind may hide
    behind the others), raised while precision is short."""
    by_kind = np.sort(planted.reshape(-1, kinds), axis=0)
    allowed = int(math.floor((1 - target_recall) * len(by_kind) + 1e-9))  # copies each kind may miss
    threshold = _at_or_below(float(by_kind[allowed].min()))
    for score in np.sort(other[other >= threshold]):
        if _rates(planted, other, threshold)[1] >= min_precision:
            break
        threshold = _above(float(score))
    return threshold


def choose_hash_signal(planted: np.ndarray, planted_hash: np.ndarray, other: np.ndarray, other_hash: np.ndarray,
                       threshold: float, min_precision: float) -> dict | None:
    """The perceptual-hash rule that finds the most planted pairs below `threshold` at `min_precision`."""
    floor = min(threshold, _at_or_below(float(np.quantile(planted, 0.01))))
    best = None
    for distance in range(MAX_HASH_DISTANCE + 1):
        found = (planted >= threshold) | ((planted >= floor) & (planted_hash <= distance))
        false = (other >= threshold) | ((other >= floor) & (other_hash <= distance))
        recall, precision = _rates(planted, other, threshold, found, false)
        if precision < min_precision:
            break
        best = {"floor": floor, "hash_distance": distance, "recall": recall, "precision": precision}
    return best


def calibrate(originals, live, opened, embed, *, sample: int = SAMPLE, seed: int = 0,
              target_recall: float = TARGET_RECALL, min_precision: float = MIN_PRECISION, created: str = "",
              model_id: str = "", progress=None) -> Calibration:
    """Measure and choose for the model whose served index is `opened`: `originals` is the seeded sample of
    its live items (imgest/state/live.py `live_sample`, `sample` of them, `seed`), `live` the whole live set
    (LiveShards: its nearest items are looked up there); `embed` turns a list of image bytes into unit vectors
    the way the catalogue's were made."""
    rng = np.random.default_rng(seed)
    # the draw that chose the sample (sample_rows), so that the copies below come from the same random stream
    rng.choice(originals.total, size=min(sample, originals.total), replace=False)
    rows = range(len(originals))
    picked, planted, planted_hash, unreadable, confirmed = [], [], [], 0, 0
    pending: list[tuple[int, list[bytes]]] = []  # originals whose copies wait to be embedded in one batch

    def embed_pending() -> None:
        if pending:
            vectors = embed([copy for _, copies in pending for copy in copies]).reshape(len(pending), len(KINDS), -1)
            for (row, _), row_vectors in zip(pending, vectors):
                planted.extend(float(s) for s in row_vectors @ originals.vectors[row])
            pending.clear()

    for n, row in enumerate(rows):
        try:
            data = originals.read_image(row)
            original = picture(data)
            copies = [make_variant(data, kind, rng) for kind in KINDS]
            pictures = [picture(copy) for copy in copies]
        except (DecodeError, StorageError, OSError, ValueError) as exc:  # one image's fault: the sample goes on
            logging.getLogger("imgest").warning("calibration skips %s: %s", originals.item_ids[row], exc)
            unreadable += 1
            continue
        original_hash = perceptual_hash(original)
        planted_hash.extend(hamming(original_hash, perceptual_hash(p)) for p in pictures)
        confirmed += sum(same_picture(original, p) for p in pictures)
        picked.append((row, original, original_hash))
        pending.append((row, copies))
        if len(pending) * len(KINDS) >= EMBED_BATCH:
            embed_pending()
        if progress is not None:
            progress(n + 1, len(rows))
    embed_pending()
    if len(picked) < MIN_SAMPLE:
        raise CalibrationError(f"only {len(picked)} of {len(rows)} sampled images could be read and decoded "
                               f"(calibration needs {MIN_SAMPLE})")
    other, other_hash, copies_held = _nearest_others(originals, live, opened, picked)
    planted_a, other_a = np.asarray(planted), np.asarray(other)
    planted_h, other_h = np.asarray(planted_hash), np.asarray(other_hash)
    threshold = choose_threshold(planted_a, other_a, target_recall, min_precision, len(KINDS))
    recall, precision = _rates(planted_a, other_a, threshold)
    recall_by_kind = by_kind(planted_a, list(KINDS), threshold)
    hash_signal = None
    if min(recall_by_kind.values()) < target_recall:
        hash_signal = choose_hash_signal(planted_a, planted_h, other_a, other_h, threshold, min_precision)
        if hash_signal is not None and hash_signal["recall"] <= recall:
            hash_signal = None  # the hash adds nothing here
    return Calibration(
        slug=originals.slug, model_id=model_id, created=created, seed=seed, items=originals.total,
        sample=[originals.item_ids[r] for r, _, _ in picked],
        sample_hashes=[originals.content_hashes[r] for r, _, _ in picked],
        kinds=list(KINDS), target_recall=target_recall, min_precision=min_precision, threshold=threshold,
        recall=recall, precision=precision, planted=[round(s, 5) for s in planted], planted_hash=planted_hash,
        other=[round(s, 5) for s in other], other_hash=other_hash, catalogue_copies=copies_held,
        unreadable=unreadable, hash_signal=hash_signal, recall_by_kind=recall_by_kind,
        confirmed=round(confirmed / len(planted), 4))


def _nearest_others(originals, live, opened, picked: list[tuple]) -> tuple[list[float], list[int], int]:
    """Each original's nearest item that is neither itself, nor its bytes, nor the same picture (by hash, or
    placed one inside the other: tasks/duplicates/verify.py). The neighbours' uris and hashes are the live set's
    (`live`, LiveShards): an item gone since the index was built is passed over."""
    queries = originals.vectors[[row for row, _, _ in picked]]
    scores, ids = opened.search(queries, min(NEIGHBOURS + 1, max(1, opened.index.ntotal)))
    names = np.full(ids.shape, None, object)
    names[ids >= 0] = opened.ids.take_array(opened.item_ids, ids[ids >= 0]).to_pylist()
    now = live.rows_of(pa.array(sorted({n for n in names.ravel() if n is not None}), pa.string()))
    current = dict(zip(now["item_id"].to_pylist(), zip(now["uri"].to_pylist(), now["content_hash"].to_pylist())))
    other, other_hash, held = [], [], 0
    for (row, original, original_hash), row_scores, row_names in zip(picked, scores, names):
        for score, name in zip(row_scores, row_names):
            if name not in current or name == originals.item_ids[row] or \
                    current[name][1] == originals.content_hashes[row]:
                continue  # gone, itself, or its bytes
            try:
                neighbour = picture(originals.read_uri(current[name][0]))
                distance = hamming(original_hash, perceptual_hash(neighbour))
                copy = distance <= SAME_PICTURE or same_picture(original, neighbour)
            except (DecodeError, StorageError, OSError, ValueError):
                distance, copy = 64, False  # unreadable: counted as a different item (the conservative side)
            if copy:
                held += 1
                continue
            other.append(float(score))
            other_hash.append(distance)
            break
    return other, other_hash, held


class CalibrationError(RuntimeError):
    """No calibration could be measured (too few readable images); one line says why."""


def write_calibration(store: Location, calibration: Calibration, run: str) -> str:
    key = f"{calibration_prefix(calibration.slug)}/{run}.json"
    store.write_json(key, asdict(calibration))
    return key


def latest_calibration(store: Location, slug: str) -> Calibration | None:
    """The newest calibration of a model, or None. A record that is not one imgest writes is skipped with a
    warning (a store's bytes are untrusted): the duplicates run then measures again."""
    names = sorted(n for n in store.list_names(calibration_prefix(slug)) if n.endswith(".json"))
    if not names:
        return None
    key = f"{calibration_prefix(slug)}/{names[-1]}"
    try:
        return parse_calibration(store.read_json(key), slug)
    except (RecordError, ValueError, TypeError) as exc:
        logging.getLogger("imgest").warning("%s: %s is not a calibration imgest wrote (%s): measuring again",
                                            store.url, key, exc)
        return None


def parse_calibration(record: object, slug: str) -> Calibration:
    if not isinstance(record, dict):
        raise RecordError("not a JSON object")
    fields = Calibration.__dataclass_fields__
    unknown = set(record) - set(fields)
    if unknown:
        raise RecordError(f"unknown fields {sorted(unknown)[:5]}")
    calibration = Calibration(**record)
    _check(calibration, slug)
    return calibration


def _check(c: Calibration, slug: str) -> None:
    def fraction(name: str, value: object, low: float = 0.0) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= 1:
            raise RecordError(f"{name} must be a number in [{low}, 1], got {str(value)[:40]!r}")

    if c.slug != slug:
        raise RecordError(f"it is model={str(c.slug)[:80]}'s")
    for name in ("model_id", "created"):
        if not isinstance(getattr(c, name), str):
            raise RecordError(f"{name} must be a string")
    for name in ("seed", "items", "catalogue_copies", "unreadable"):
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise RecordError(f"{name} must be a non-negative integer")
    for name in ("threshold", "recall", "precision", "target_recall", "min_precision", "confirmed"):
        fraction(name, getattr(c, name))
    if c.threshold <= 0:
        raise RecordError("threshold must be above 0")
    for name, kind in (("sample", str), ("sample_hashes", str), ("kinds", str), ("planted", (int, float)),
                       ("other", (int, float)), ("planted_hash", int), ("other_hash", int)):
        values = getattr(c, name)
        if not isinstance(values, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in values):
            raise RecordError(f"{name} must be a list of {getattr(kind, '__name__', 'numbers')}")
    if len(c.sample) != len(c.sample_hashes) or len(c.planted) != len(c.planted_hash) or \
            len(c.other) != len(c.other_hash):
        raise RecordError("its lists do not pair up")
    if not isinstance(c.recall_by_kind, dict) or set(c.recall_by_kind) - set(c.kinds):
        raise RecordError("recall_by_kind must map its kinds to fractions")
    for kind, value in c.recall_by_kind.items():
        fraction(f"recall_by_kind.{kind}", value)
    if len(c.kinds) == 0 or len(c.planted) % len(c.kinds):
        raise RecordError("planted must hold one score of every kind per sampled image")
    if c.hash_signal is not None:
        signal = c.hash_signal
        if not isinstance(signal, dict) or set(signal) != {"floor", "hash_distance", "recall", "precision"}:
            raise RecordError("hash_signal must be {floor, hash_distance, recall, precision}")
        for name in ("floor", "recall", "precision"):
            fraction(f"hash_signal.{name}", signal[name], low=-1.0)
        distance = signal["hash_distance"]
        if isinstance(distance, bool) or not isinstance(distance, int) or not 0 <= distance <= MAX_HASH_DISTANCE:
            raise RecordError(f"hash_signal.hash_distance must be an integer in [0, {MAX_HASH_DISTANCE}]")


def stale(calibration: Calibration, model_id: str, items: int, sample_now: dict[str, str]) -> str | None:
    """Why a calibration no longer describes the model and catalogue (one phrase), or None while it does.
    `items`: how many are live now; `sample_now`: item_id -> content hash of those of the calibration's sampled
    items still live."""
    if calibration.model_id != model_id:
        return f"it measured {calibration.model_id}, the model is now {model_id}"
    if abs(items - calibration.items) > STALE_SHARE * max(calibration.items, 1):
        return f"the catalogue went from {calibration.items:,} to {items:,} live items"
    kept = sum(sample_now.get(item) == h for item, h in zip(calibration.sample, calibration.sample_hashes))
    if kept < (1 - STALE_SHARE) * len(calibration.sample):
        return f"only {kept} of its {len(calibration.sample)} sampled images are still live and unchanged"
    return None
