"""A duplicates run's two steps: which threshold (the operator's, the model's calibration on this catalogue,
measured now if missing or stale, or the fixed default when none can be measured), then the search.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from imgest.images.decode import DecodeError, decode_as
from imgest.names import DEFAULT_DUPLICATE_THRESHOLD
from imgest.progress import report
from imgest.state.catalogue_images import CatalogueImages, CatalogueRootError
from imgest.state.clock import now_iso
from imgest.state.committed import LIVE, load_state
from imgest.state.live import LiveShards, live_sample, live_set
from imgest.state.lock import Fence
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
from imgest.tasks.duplicates.groups import SIGNALS, group_items
from imgest.tasks.duplicates.hashes import HashCache, perceptual_hash, picture
from imgest.tasks.duplicates.report import DuplicateReport, summary, write_report
from imgest.tasks.duplicates.scan import NEIGHBOURS, Candidates, candidates, scan_pairs
from imgest.tasks.duplicates.verify import same_picture


def _stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")


def _searcher(store_url: str, alias: str | None, model: str | None):
    from imgest.retrieval.query import Searcher, SearchError

    searcher = Searcher(store_url, alias, model)
    if "image" not in searcher.spec.modalities:
        raise SearchError(f"{searcher.card['model_name']} is a text model: duplicates are found with an image "
                          "model's index")
    return searcher


def embedder(searcher, batch: int = 32):
    """Image bytes -> unit vectors, decoded and preprocessed as the catalogue's were."""
    def embed(images: list[bytes]) -> np.ndarray:
        encoder = searcher.encoder()
        decode = searcher.decode()
        out = []
        for begin in range(0, len(images), batch):
            pixels = [encoder.preprocess(decode_as(data, decode))
                      for data in images[begin:begin + batch]]
            out.append(np.asarray(encoder.encode_images(np.stack(pixels)), np.float32))
        vectors = np.concatenate(out)
        return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    return embed


class _Progress:
    """A progress artifact in the UI (moved at each whole percent: a 10M search passes 5,000 shards) and the
    terminal's bar."""

    def __init__(self, what: str, key: str, total: int, unit: str):
        self.what, self.unit, self.shown = what, unit, -1
        self.artifact = create_progress_artifact(0.0, key=key, description=f"{total} {unit}")

    def __call__(self, done: int, total: int) -> None:
        percent = 100.0 * done / max(total, 1)
        if int(percent) != self.shown or done == total:
            update_progress_artifact(self.artifact, percent, description=f"{done}/{total} {self.unit}")
            self.shown = int(percent)
        report(self.what, done, total, self.unit)


def choose(store_url: str, alias: str | None, model: str | None, threshold: float | None, recalibrate: bool,
           sample: int = SAMPLE, target_recall: float = TARGET_RECALL, seed: int = 0, fence: Fence | None = None
           ) -> dict:
    """{threshold, threshold_source, calibration (its figures, or None), hash_signal, reason (why not
    calibrated)}. Measuring writes a calibration record (fenced)."""
    searcher = _searcher(store_url, alias, model)
    card = searcher.card
    current = latest_calibration(searcher.store, card["slug"])
    if recalibrate or current is None:
        why = "--calibrate" if recalibrate else "no calibration yet"
    else:  # the live count and the sampled items' rows, asked of the state (the live set is numbered only to measure)
        state = load_state(searcher.store, card["slug"])
        try:
            now = {item: row.content_hash for item, row in state.rows(current.sample).items() if row.status == LIVE}
            why = stale(current, card["model_id"], state.count(LIVE), now)
        finally:
            state.close()
    if threshold is not None:  # the operator's; figures from the latest calibration when it still applies
        figures = current.at(threshold) if current is not None and why is None else None
        return {"threshold": threshold, "threshold_source": "--threshold", "calibration": figures,
                "hash_signal": None, "reason": None}
    if why is not None:
        logging.getLogger("imgest").info("calibrating the duplicate threshold of model=%s: %s", card["slug"], why)
        live = live_set(searcher.store, card["slug"])
        picked = live_sample(searcher.store, card["slug"], searcher.spec.dim, live, sample, seed)
        try:
            current = calibrate(picked, live, searcher.opened, embedder(searcher), sample=sample, seed=seed,
                                target_recall=target_recall, created=now_iso(), model_id=card["model_id"],
                                progress=_Progress(f"calibrating {card['slug']}", "duplicates-calibration",
                                                   len(picked), "sampled images"))
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


def hash_pairs(store: Location, live: LiveShards, found: Candidates, band: np.ndarray, images, signal: dict,
               run: str, fence: Fence | None = None) -> np.ndarray:
    """Which of the candidate pairs `band` (their indices: scoring in [floor, threshold)) have perceptual hashes
    within the calibrated distance. Hashes are looked up in the store's cache for these pairs' images only;
    missing ones are computed from the images (one per content hash) and the cache written again (fenced), kept
    for the images live now. The band's items, their content hashes and perceptual hashes stay Arrow and NumPy
    columns: the only Python values are the uris of the images hashed now, a batch at a time."""
    if not len(band):
        return np.zeros(0, bool)
    codes = np.unique(np.concatenate([found.a[band], found.b[band]]))
    rows = found.rows(codes, live.folder)  # (code, content_hash, uri) of the band's items
    cache = HashCache(store, max_rows=4 * len(live) + 1024)  # the live items' hashes and those of the recently gone
    hashes = rows["content_hash"].combine_chunks()
    known = cache.lookup(pc.unique(hashes))
    missing = pc.unique(hashes.filter(pc.invert(pc.is_in(hashes, value_set=known["content_hash"]))))
    first = rows.take(pc.index_in(missing, value_set=hashes))  # one image per content hash is read
    computed, ok, failed = np.zeros(len(first), np.uint64), np.zeros(len(first), bool), 0
    for start in range(0, len(first), HASH_BATCH):
        for i, uri in enumerate(first["uri"].slice(start, HASH_BATCH).to_pylist(), start):
            try:
                computed[i], ok[i] = perceptual_hash(picture(images.read(uri))), True
            except (DecodeError, ContainmentError, StorageError, OSError) as exc:  # that item has no hash signal
                failed += 1
                logging.getLogger("imgest").debug("no perceptual hash for %s: %s", uri, exc)
    if failed:
        logging.getLogger("imgest").warning("%d of %d images could not be hashed: only the embedding judges them",
                                            failed, len(first))
    hashed = pa.table({"content_hash": missing.filter(pa.array(ok)), "phash": pa.array(computed[ok], pa.uint64())})
    if len(hashed):
        if fence is not None:
            fence.check(store)
        cache.write(hashed, live.ordered, run)
    every = pa.concat_tables([known, hashed.cast(known.schema)])
    at = pc.index_in(hashes, value_set=every["content_hash"])  # each band item's row of `every` (null: none)
    has_row = pc.is_valid(at).to_numpy(zero_copy_only=False)
    phash, has = np.zeros(len(found), np.uint64), np.zeros(len(found), bool)
    row_codes = rows["code"].to_numpy()
    phash[row_codes[has_row]] = every["phash"].to_numpy()[at.drop_null().to_numpy()]
    has[row_codes[has_row]] = True
    a, b = found.a[band], found.b[band]
    return has[a] & has[b] & (np.bitwise_count(phash[a] ^ phash[b]) <= signal["hash_distance"])


HASH_BATCH = 1_024  # uris of images to hash, turned into Python strings at a time


def confirmed(found: Candidates, pairs: np.ndarray, check: PictureCheck, folder: str) -> np.ndarray:
    """Whether each of the candidate pairs `pairs` (their indices) is confirmed by its two pictures: their uris
    joined in DuckDB and read a batch at a time."""
    from imgest.state.rows import scratch_sql, sql_string

    ok = np.zeros(len(pairs), bool)
    items = f"read_parquet({sql_string(found.items)})"
    with scratch_sql(folder) as con:
        con.register("wanted", pa.table({"n": np.arange(len(pairs)), "a": found.a[pairs], "b": found.b[pairs]}))
        reader = con.sql(f"""SELECT w.n, i.uri AS ua, j.uri AS ub FROM wanted AS w JOIN {items} AS i ON i.code = w.a
                             JOIN {items} AS j ON j.code = w.b ORDER BY w.a, w.b""").to_arrow_reader(4096)
        for batch in reader:
            for n, first, second in zip(batch["n"].to_numpy(), batch["ua"].to_pylist(), batch["ub"].to_pylist()):
                ok[n] = check(first, second)
    return ok


def find(store_url: str, alias: str | None, model: str | None, choice: dict, fence: Fence | None = None) -> dict:
    """Search every live item against the served index at the chosen threshold (and hash rule), a shard at a
    time; group the pairs that pass as columns; write the report (fenced); return its summary with the
    artifact's text."""
    searcher = _searcher(store_url, alias, model)
    card, opened, slug = searcher.card, searcher.opened, searcher.card["slug"]
    live = live_set(searcher.store, slug)
    threshold, signal = choice["threshold"], choice.get("hash_signal")
    floor = min(threshold, signal["floor"]) if signal else threshold
    progress = _Progress(f"duplicates of {slug}", "duplicates-search", len(live), "items")
    path = scan_pairs(searcher.store, slug, searcher.spec.dim, live, opened, floor,
                      min(NEIGHBOURS, max(1, opened.index.ntotal)), lambda done: progress(done, len(live)))
    found = candidates(live, path)
    which = np.where(found.score >= threshold, SIGNALS.index("embedding"), -1).astype(np.int8)  # per pair: its signal
    calibrated, images, run = choice["threshold_source"] == "calibration", None, _stamp()
    if signal or calibrated:  # both look at pictures, read only under the model's catalogue root
        try:
            images = CatalogueImages(searcher.store, slug)
        except CatalogueRootError as exc:
            lost = [what for what, needed in (("no perceptual-hash signal", signal),
                                              ("near pairs not confirmed by their pictures", calibrated)) if needed]
            logging.getLogger("imgest").warning("%s: %s", "; ".join(lost), exc)
    if signal and images is not None:
        band = np.nonzero((found.score >= signal["floor"]) & (found.score < threshold))[0]
        which[band[hash_pairs(searcher.store, live, found, band, images, signal, run, fence)]] = SIGNALS.index("hash")
    joined = np.nonzero(which >= 0)[0]
    report = DuplicateReport(slug, card["model_id"], threshold, len(live),
                             threshold_source=choice["threshold_source"], calibration=choice["calibration"])
    if calibrated and images is not None:  # a calibrated threshold sits at the edge of different items: each near
        ok = confirmed(found, joined, PictureCheck(images), live.folder)  # pair is confirmed by its pictures
        report.refused_pairs, joined = int((~ok).sum()), joined[ok]
    a, b, score, which = found.a[joined], found.b[joined], found.score[joined], which[joined]
    groups = group_items(found.hash_code, a, b, score, which)
    write_report(searcher.store, report, found, groups, a, b, score, which, run, live.folder, fence)
    return summary(searcher.store, report)


class PictureCheck:
    """Confirms a near pair by looking at both pictures (tasks/duplicates/verify.py). A picture that cannot be
    read leaves the pair to the embedding's judgement. The last KEPT pictures are kept (pairs come in order of
    their first item, which most repeats)."""

    KEPT = 256

    def __init__(self, images):
        self.images = images
        self.pictures: OrderedDict[str, object] = OrderedDict()

    def picture(self, uri: str):
        if uri in self.pictures:
            self.pictures.move_to_end(uri)
            return self.pictures[uri]
        try:
            image = picture(self.images.read(uri))
        except (DecodeError, ContainmentError, StorageError, OSError) as exc:
            logging.getLogger("imgest").debug("no picture check for %s: %s", uri, exc)
            image = None
        self.pictures[uri] = image
        if len(self.pictures) > self.KEPT:
            self.pictures.popitem(last=False)
        return image

    def __call__(self, a: str, b: str) -> bool:
        first, second = self.picture(a), self.picture(b)
        return first is None or second is None or same_picture(first, second)


@task(name="choose-threshold", cache_policy=NO_CACHE)
def choose_task(store_url: str, alias: str | None, model: str | None, threshold: float | None, recalibrate: bool,
                sample: int, target_recall: float, fence: Fence | None = None) -> dict:
    return choose(store_url, alias, model, threshold, recalibrate, sample, target_recall, fence=fence)


@task(name="find-duplicates", cache_policy=NO_CACHE)
def find_task(store_url: str, alias: str | None, model: str | None, choice: dict, fence: Fence | None = None) -> dict:
    return find(store_url, alias, model, choice, fence)

