"""A duplicates run's two steps: which threshold (the operator's, the model's calibration on this catalogue,
measured now if missing or stale, or the fixed default when none can be measured), then the search.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import numpy as np
from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from imgest.lock import Fence
from imgest.names import DEFAULT_DUPLICATE_THRESHOLD
from imgest.progress import report
from imgest.storage import ContainmentError, Location, StorageError
from imgest.tasks.duplicates.calibrate import (
    SAMPLE,
    TARGET_RECALL,
    CalibrationError,
    calibrate,
    latest_calibration,
    stale,
    write_calibration,
)
from imgest.tasks.duplicates.groups import NEIGHBOURS, DuplicateReport, find_and_report
from imgest.tasks.duplicates.hashes import hamming, perceptual_hash, picture, read_hashes, write_hashes
from imgest.tasks.duplicates.verify import same_picture
from imgest.tasks.ingest.decode import DecodeError, decode_image
from imgest.tasks.state.catalogue_images import CatalogueRootError
from imgest.tasks.state.committed import now_iso


def _stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")


def _searcher(store_url: str, alias: str | None, model: str | None):
    from imgest.tasks.search.query import Searcher, SearchError

    searcher = Searcher(store_url, alias, model)
    if "image" not in searcher.spec.modalities:
        raise SearchError(f"{searcher.card['model_name']} is a text model: duplicates are found with an image "
                          "model's index")
    return searcher


def embedder(searcher, batch: int = 32):
    """Image bytes -> unit vectors, decoded and preprocessed as the catalogue's were."""
    def embed(images: list[bytes]) -> np.ndarray:
        encoder = searcher.encoder()
        side = getattr(encoder, "decode_side", None)
        out = []
        for begin in range(0, len(images), batch):
            pixels = [encoder.preprocess(decode_image(data, min_side=side)) for data in images[begin:begin + batch]]
            out.append(np.asarray(encoder.encode_images(np.stack(pixels)), np.float32))
        vectors = np.concatenate(out)
        return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    return embed


class _Progress:
    def __init__(self, slug: str, total: int):
        self.what = f"calibrating {slug}"
        self.artifact = create_progress_artifact(0.0, key="duplicates-calibration",
                                                 description=f"copies of {total} sampled images")

    def __call__(self, done: int, total: int) -> None:
        update_progress_artifact(self.artifact, 100.0 * done / total, description=f"{done}/{total} sampled images")
        report(self.what, done, total, "images")


def choose(store_url: str, alias: str | None, model: str | None, threshold: float | None, recalibrate: bool,
           sample: int = SAMPLE, target_recall: float = TARGET_RECALL, seed: int = 0, fence: Fence | None = None
           ) -> dict:
    """{threshold, threshold_source, calibration (its figures, or None), hash_signal, reason (why not
    calibrated)}. Measuring writes a calibration record (fenced)."""
    from imgest.tasks.state.live import load_live_vectors

    searcher = _searcher(store_url, alias, model)
    card = searcher.card
    live = load_live_vectors(searcher.store, card["slug"], searcher.spec.dim)
    current = latest_calibration(searcher.store, card["slug"])
    why = "--calibrate" if recalibrate else "no calibration yet" if current is None else \
        stale(current, card["model_id"], dict(zip(live.item_ids, live.content_hashes)))
    if threshold is not None:  # the operator's; figures from the latest calibration when it still applies
        figures = current.at(threshold) if current is not None and why is None else None
        return {"threshold": threshold, "threshold_source": "--threshold", "calibration": figures,
                "hash_signal": None, "reason": None}
    if why is not None:
        logging.getLogger("imgest").info("calibrating the duplicate threshold of model=%s: %s", card["slug"], why)
        try:
            current = calibrate(live, searcher.opened, embedder(searcher), sample=sample, seed=seed,
                                target_recall=target_recall, created=now_iso(), model_id=card["model_id"],
                                progress=_Progress(card["slug"], min(sample, len(live))))
        except (CalibrationError, CatalogueRootError) as exc:
            logging.getLogger("imgest").warning("duplicates of model=%s use the fixed threshold %s: no "
                                                "calibration (%s)", card["slug"], DEFAULT_DUPLICATE_THRESHOLD, exc)
            return {"threshold": DEFAULT_DUPLICATE_THRESHOLD, "threshold_source": "default", "calibration": None,
                    "hash_signal": None, "reason": str(exc)}
        if fence is not None:
            fence.check(searcher.store)
        write_calibration(searcher.store, current, _stamp())
    return {"threshold": current.threshold, "threshold_source": "calibration", "calibration": current.summary(),
            "hash_signal": current.hash_signal, "reason": None}


def hash_pairs(store: Location, live, scores: np.ndarray, neighbours: np.ndarray, threshold: float,
               signal: dict, run: str, fence: Fence | None = None) -> list[tuple[int, int, float]]:
    """Pairs among each item's nearest neighbours scoring in [floor, threshold) whose perceptual hashes are
    within the calibrated distance. Hashes are read from the store's cache; missing ones are computed from the
    images and written back (fenced)."""
    candidates = {(min(n, int(m)), max(n, int(m))): float(s) for n, (row_s, row_m) in enumerate(zip(scores, neighbours))
                  for s, m in zip(row_s, row_m) if m >= 0 and m != n and signal["floor"] <= s < threshold}
    if not candidates:
        return []
    known = read_hashes(store, max_rows=4 * len(live) + 1024)  # the live items' hashes and those of the recently gone
    rows = sorted({r for pair in candidates for r in pair})
    missing = [r for r in rows if live.content_hashes[r] not in known]
    failed = 0
    for row in missing:
        try:
            known[live.content_hashes[row]] = perceptual_hash(picture(live.read_image(row)))
        except (DecodeError, ContainmentError, StorageError, OSError) as exc:  # that item has no hash signal
            failed += 1
            logging.getLogger("imgest").debug("no perceptual hash for %s: %s", live.item_ids[row], exc)
    if failed:
        logging.getLogger("imgest").warning("%d of %d images could not be hashed: only the embedding judges them",
                                            failed, len(missing))
    if len(missing) > failed:
        if fence is not None:
            fence.check(store)
        current = set(live.content_hashes)  # hashes of images no longer live are not carried on
        write_hashes(store, {h: value for h, value in known.items() if h in current}, run)
    pairs = []
    for (n, m), score in candidates.items():
        a, b = known.get(live.content_hashes[n]), known.get(live.content_hashes[m])
        if a is not None and b is not None and hamming(a, b) <= signal["hash_distance"]:
            pairs.append((n, m, score))
    return pairs


def find(store_url: str, alias: str | None, model: str | None, choice: dict, fence: Fence | None = None) -> dict:
    """Search every live item against the served index at the chosen threshold (and hash rule); write the
    report (fenced); return it with the artifact's text."""
    from imgest.tasks.state.live import load_live_vectors

    searcher = _searcher(store_url, alias, model)
    card, opened = searcher.card, searcher.opened
    live = load_live_vectors(searcher.store, card["slug"], searcher.spec.dim)
    position = {item: n for n, item in enumerate(live.item_ids)}
    indexed = [position.get(item, -1) for item in opened.item_ids.to_pylist()]  # faiss id -> live row (-1: gone since)
    scores, ids = opened.search(live.vectors, min(NEIGHBOURS, max(1, opened.index.ntotal)))
    neighbours = np.where(ids >= 0, np.asarray(indexed + [-1], np.int64)[ids], -1)
    run = _stamp()
    extra = []
    if choice.get("hash_signal"):
        try:
            extra = hash_pairs(searcher.store, live, scores, neighbours, choice["threshold"], choice["hash_signal"],
                               run, fence)
        except CatalogueRootError as exc:
            logging.getLogger("imgest").warning("no perceptual-hash signal: %s", exc)
    report = DuplicateReport(card["slug"], card["model_id"], choice["threshold"], len(live),
                             threshold_source=choice["threshold_source"], calibration=choice["calibration"])
    confirm = None
    if choice["threshold_source"] == "calibration":  # a calibrated threshold sits at the edge of different items
        try:
            confirm = PictureCheck(live)
        except CatalogueRootError as exc:
            logging.getLogger("imgest").warning("near pairs not confirmed by their pictures: %s", exc)
    return find_and_report(searcher.store, report, live, scores, neighbours, extra, run, fence, confirm)


class PictureCheck:
    """Confirms a near pair by looking at both pictures (tasks/duplicates/verify.py). A picture that cannot be
    read leaves the pair to the embedding's judgement."""

    def __init__(self, live):
        from imgest.tasks.state.catalogue_images import CatalogueImages

        self.live = live
        CatalogueImages(Location(live.store_url), live.slug, live.catalogue)  # no catalogue root: refused now
        self.pictures: dict[int, object] = {}

    def picture(self, row: int):
        if row not in self.pictures:
            try:
                self.pictures[row] = picture(self.live.read_image(row))
            except (DecodeError, ContainmentError, StorageError, OSError) as exc:
                logging.getLogger("imgest").debug("no picture check for %s: %s", self.live.item_ids[row], exc)
                self.pictures[row] = None
        return self.pictures[row]

    def __call__(self, a: int, b: int) -> bool:
        first, second = self.picture(a), self.picture(b)
        return first is None or second is None or same_picture(first, second)


@task(name="choose-threshold", cache_policy=NO_CACHE)
def choose_task(store_url: str, alias: str | None, model: str | None, threshold: float | None, recalibrate: bool,
                sample: int, target_recall: float, fence: Fence | None = None) -> dict:
    return choose(store_url, alias, model, threshold, recalibrate, sample, target_recall, fence=fence)


@task(name="find-duplicates", cache_policy=NO_CACHE)
def find_task(store_url: str, alias: str | None, model: str | None, choice: dict, fence: Fence | None = None) -> dict:
    return find(store_url, alias, model, choice, fence)

