"""The index-build tasks: load live vectors, train and fill (in one process or in parallel parts), tune,
write a version, verify it and move its aliases, and the JSON build records that let a nightly with nothing
new reuse the last version. Which of them run, in which order, is the build-version flow's decision."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections import Counter
from dataclasses import dataclass

import faiss
import numpy as np
import pyarrow as pa
from prefect import get_run_logger, task, unmapped
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import quote

from imgest.names import DEFAULT_DISK
from imgest.policy import IO_RETRIES
from imgest.progress import report
from imgest.retrieval.versions import (
    IdMapFile,
    IndexIntegrityError,
    ids_file,
    previous_version,
    read_card,
    read_index_for_update,
    read_truth,
    version_counts,
    version_exists,
    write_version,
)
from imgest.runners import shard_runner
from imgest.state.aliases import aliases_to_move, set_alias
from imgest.state.committed import LIVE, load_state
from imgest.state.drift import Reference, reference, write_reference
from imgest.state.layout import build_record_key
from imgest.state.live import LiveShards, live_set
from imgest.state.lock import Fence
from imgest.storage import Location
from imgest.tasks.index.build import (
    BuildTimes,
    add_part,
    merge_parts,
    mergeable,
    part_ranges,
    train,
    warn_if_generic_blas,
)
from imgest.tasks.index.card import make_card
from imgest.tasks.index.choice import IndexChoice, choose_index, kept_fallback, nightly_fallback, refines
from imgest.tasks.index.parts import PartSpec, add_store_part, merge_id_parts, merge_truth, plan_parts
from imgest.tasks.index.stream import Streamed, adds_by_shard, read_sample, stream_build
from imgest.tasks.index.truth import Truth, carry_truth
from imgest.tasks.index.tuning import TRUTH_DEPTH_PER_K, Tuned, tune_with_truth
from imgest.tasks.index.update import (
    NotUpdatable,
    apply_delta,
    built_lineage,
    check_drift,
    check_served,
    made_by_shards,
    plan_delta,
    updatable,
    updated_lineage,
)
from imgest.timing import Stopwatch

MIN_USABLE_PROBES = 0.8  # below this share of probes with a known exact top-k, the recall is measured afresh


class AddProgress:
    """Vectors added so far, for a person: the command's terminal bar and the run's progress artifact."""

    def __init__(self, slug: str, total: int):
        self.what, self.total = f"{slug} index", total
        self.artifact = create_progress_artifact(0.0, key="index-progress", description=f"adding {total:,} vectors")
        report(self.what, 0, total, "vectors")

    def __call__(self, done: int) -> None:
        update_progress_artifact(self.artifact, 100.0 * done / self.total,
                                 description=f"{done:,}/{self.total:,} vectors added")
        report(self.what, done, self.total, "vectors")


@task(name="train-index", cache_policy=NO_CACHE)
def train_task(vectors: np.ndarray, choice: IndexChoice, rows: np.ndarray | None = None) -> bytes:
    warn_if_generic_blas()
    return faiss.serialize_index(train(vectors, choice, rows=rows)).tobytes()


@task(name="add-part", cache_policy=NO_CACHE, retries=1, task_run_name="add-part-{start}")
def add_part_task(trained: bytes, vectors: np.ndarray, start: int) -> tuple[int, bytes]:
    return start, add_part(trained, vectors)


@task(name="add-store-part", cache_policy=NO_CACHE, retries=1, task_run_name="add-store-part-{number}")
def add_store_part_task(trained: bytes, spec: PartSpec, probes: np.ndarray, depth: int, number: int) -> dict:
    return add_store_part(trained, spec, probes, depth)


@task(name="number-live", cache_policy=NO_CACHE, **IO_RETRIES)
def live_shards_task(store_url: str, slug: str) -> LiveShards:
    """The live set numbered on local disk (see LiveShards); the state's database closed before the build."""
    return live_set(Location(store_url), slug)


@task(name="build-index", cache_policy=NO_CACHE)
def stream_build_task(store_url: str, model: dict, live: LiveShards, choice: IndexChoice, queries: int, depth: int,
                      on_added: AddProgress | None = None, add_parts=None) -> Streamed:
    warn_if_generic_blas()
    return stream_build(Location(store_url), model["slug"], int(model["dim"]), live, choice, queries, depth,
                        on_added, add_parts)


@task(name="tune-search", cache_policy=NO_CACHE)
def tune_task(index, truth: Truth, target: float, k: int) -> Tuned:
    return tune_with_truth(index, truth, target, k)


@task(name="update-index", cache_policy=NO_CACHE)
def update_task(store_url: str, model: dict, previous: dict | None, kind: str, memory: str, target_recall: float,
                k: int, retrain_share: float, disk: str = DEFAULT_DISK) -> dict:
    """Carry `previous` forward to the live state (see tasks/index/update.py): the new index, id map, exact
    lists and card; or {"why": ...}, the reason to train a new index instead (a decision, not a failure)."""
    try:
        return update_version(store_url, model, previous, kind, memory, target_recall, k, retrain_share, disk)
    except NotUpdatable as exc:
        return {"why": str(exc)}
    except (IndexIntegrityError, FileNotFoundError) as exc:  # the old version's fault, not this build's: train anew
        return {"why": f"v{previous['version']:04d} cannot be carried forward: {exc}"}


def update_version(store_url: str, model: dict, previous: dict | None, kind: str, memory: str, target_recall: float,
                   k: int, retrain_share: float, disk: str = DEFAULT_DISK) -> dict:
    total = Stopwatch()
    store, slug, d = Location(store_url), model["slug"], int(model["dim"])
    state = load_state(store, slug)
    choice = choose_index(state.count(LIVE), d, memory, kind, disk)
    truth_table = read_truth(store, previous) if previous else None
    updatable(previous, choice.factory, truth_table is not None)
    if previous["recall"]["k"] != k:
        raise NotUpdatable(f"recall is now measured at k={k}; v{previous['version']:04d} kept lists for "
                           f"k={previous['recall']['k']}")
    delta = plan_delta(store, slug, d, ids_file(store, previous), state)
    seq = state.seq
    state.close()  # its DuckDB (up to its memory cap) goes before the index comes into memory
    line = updated_lineage(previous, len(delta.added), delta.removed, retrain_share)
    check_drift(line)
    index = read_index_for_update(store, previous)
    with Stopwatch() as adding:
        index = apply_delta(index, delta)
    truth = carry_truth(Truth.from_table(truth_table), delta.remap, delta.added_ids, delta.added)
    usable = float(truth.usable(k).mean())
    if usable < MIN_USABLE_PROBES:
        raise NotUpdatable(f"only {usable:.0%} of the recall probes still have an exact top-{k}: measured afresh")
    tuned = tune_with_truth(index, truth, target_recall, k)
    check_served(line, tuned)
    times = BuildTimes(0.0, adding.seconds, total.seconds)
    card = make_card(model, delta.ids.rows, d, seq, choice, memory, times, tuned, line, index, disk,
                     *made_by_shards(store, slug, delta.by_shard))
    card["build"] = {"parts": 1, "runner": "local", "method": "updated in place: faiss remove_ids, ids renumbered "
                                                              "to item_id order, add_with_ids of the new vectors"}
    get_run_logger().info("index model=%s: %s", slug, line["why"])
    return {"index": index, "ids": delta.ids, "truth": truth.to_table(), "card": card}


@task(name="write-version", cache_policy=NO_CACHE, **IO_RETRIES)
def write_version_task(store_url: str, index, ids: pa.Table | IdMapFile, card: dict, fence: Fence | None = None,
                       truth: pa.Table | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="imgest-index-") as folder:  # a file, not a second copy in memory
        path = os.path.join(folder, "index.faiss")
        faiss.write_index(index, path)
        return write_version(Location(store_url), card["slug"], path, ids, card, fence, truth)


@task(name="verify-and-alias", cache_policy=NO_CACHE)
def verify_and_alias_task(store_url: str, card: dict, alias: str | None, fence: Fence | None = None) -> list[dict]:
    """Re-open the written version (checksums, vector count) before any alias points at it."""
    store = Location(store_url)
    vectors, rows = version_counts(store, card)
    if vectors != card["n"] or rows != card["n"]:
        raise RuntimeError(f"index v{card['version']} holds {vectors} vectors and {rows} ids, card says {card['n']}")
    return [set_alias(store, name, card, reason=f"build v{card['version']:04d}", fence=fence)
            for name in aliases_to_move(store, card["slug"], alias)]


def build_in_parts(vectors: np.ndarray, choice: IndexChoice, parts: int, runner: str, workers: int,
                   on_added: AddProgress | None = None, rows: np.ndarray | None = None):
    """Train once here; add `parts` contiguous slices in parallel on the runner (local threads or a Dask
    cluster); merge them in id order with faiss's own merge. Same index as one build (tested)."""
    logger = get_run_logger()
    total = Stopwatch()
    with Stopwatch() as training:
        trained = train_task(vectors, choice, rows)
    ranges = part_ranges(len(vectors), parts)
    if not mergeable(faiss.deserialize_index(np.frombuffer(trained, np.uint8))):
        logger.info("%s does not merge (an HNSW graph is one structure): adding in this process, where faiss "
                    "already uses every core", choice.factory)
        ranges = [(0, len(vectors))]
    adding = Stopwatch()
    with shard_runner(runner, workers) as part_runner:
        futures = part_runner.map(add_part_task, {"trained": unmapped(trained),
                                                  "vectors": [vectors[a:b] for a, b in ranges],
                                                  "start": [a for a, _ in ranges]})
        added = []
        for (_, stop), future in zip(ranges, futures):
            added.append(future.result())
            if on_added is not None:
                on_added(stop)
        index = merge_parts(trained, added)
    times = BuildTimes(training.seconds, adding.seconds, total.seconds)
    return index, times, len(ranges)


def build_from_store(store_url: str, model: dict, live: LiveShards, choice: IndexChoice, parts: int, runner: str,
                     workers: int, queries: int, depth: int, on_added: AddProgress | None = None):
    """An IVF build whose vectors never gather on this node (see tasks/index/parts.py): the training rows
    (whole shards) and the probes among them read here; each part reads its own shards on the runner."""
    total = Stopwatch()
    store, slug, d = Location(store_url), model["slug"], int(model["dim"])
    sample = read_sample(store, slug, d, live, choice.train_size)
    trained = train_task(sample.vectors, choice, np.arange(len(sample.rows)))
    at = sample.probes(queries)
    probes, probes_at = np.ascontiguousarray(sample.vectors[at]), sample.rows[at]
    drift = reference(sample.vectors)
    del sample  # trained: not held while the parts fill
    train_seconds = total.seconds  # reading the training rows is part of training here
    specs = plan_parts(store_url, slug, d, live, parts)
    adding, results, done = Stopwatch(), [], 0
    with shard_runner(runner, workers) as part_runner:
        futures = part_runner.map(add_store_part_task, {"trained": unmapped(trained), "spec": specs,
                                                        "probes": unmapped(probes), "depth": unmapped(depth),
                                                        "number": list(range(len(specs)))})
        for spec, future in zip(specs, futures):
            results.append(future.result())
            done += spec.rows
            if on_added is not None:
                on_added(done)
    index = merge_id_parts(trained, [r["index"] for r in results])
    truth = merge_truth(probes, probes_at, results, len(live), depth)
    times = BuildTimes(train_seconds, adding.seconds, total.seconds)
    encoded_by = sum((Counter(r["encoded_by"]) for r in results), Counter())
    decoded_by = sum((Counter(r.get("decoded_by") or {}) for r in results), Counter())
    return index, times, len(specs), truth, drift, dict(encoded_by), dict(decoded_by)


@dataclass
class Built:
    """A new index version before it is written: the index, its ids, the probes' exact neighbours, how it was
    made."""

    index: object
    ids: pa.Table | IdMapFile
    truth: Truth
    snapshot: int
    times: BuildTimes
    parts: int
    method: str
    reference: Reference | None = None  # what the new images of later nights are measured against (drift)
    encoded_by: dict[str, int] | None = None  # indexed rows per "runtime precision", counted as the shards were read
    decoded_by: dict[str, int] | None = None  # and per JPEG decoder that made them


def build_streamed(store_url: str, model: dict, live: LiveShards, choice: IndexChoice, parts: int, runner: str,
                   workers: int, queries: int, depth: int, progress: AddProgress) -> Built:
    """Trained on a sample of whole shards and filled shard by shard (tasks/index/stream.py); the kinds that need
    every vector at once (HNSW, flat, re-rank vectors) in `parts` slices added in parallel on the runner."""
    add_parts = None
    if parts > 1 and not adds_by_shard(choice) and choice.refine != "disk":
        def add_parts(vectors, choice, rows):
            return build_in_parts(vectors, choice, parts, runner, workers, progress, rows)
    streamed = stream_build_task(store_url, model, live, choice, queries, depth, progress, add_parts)
    used = parts if add_parts is not None else 1
    if adds_by_shard(choice):
        method = "trained on whole shards read first; every shard then read once and added with its faiss ids"
    elif choice.refine == "disk":
        method = ("shards read once into a memory map in faiss id order; trained, the PQ codes added in RAM and "
                  "the re-rank vectors written to the index file a block at a time (memory-mapped)")
    else:
        method = ("shards read once into a memory map in faiss id order; trained and added " +
                  ("in one process" if used == 1 else "in parts in parallel, merged in id order (faiss merge_from)"))
    times = BuildTimes(streamed.train_seconds, streamed.add_seconds, streamed.train_seconds + streamed.add_seconds)
    return Built(streamed.index, streamed.ids, streamed.truth, live.snapshot, times, used, method,
                 streamed.reference, streamed.encoded_by, streamed.decoded_by)


def build_from_store_parts(store_url: str, model: dict, live: LiveShards, choice: IndexChoice, parts: int,
                           runner: str, workers: int, queries: int, depth: int, progress: AddProgress) -> Built:
    """An IVF build whose vectors never gather on this node: each part reads its own shards on the runner."""
    index, times, used, truth, drift, encoded_by, decoded_by = build_from_store(
        store_url, model, live, choice, parts, runner, workers, queries, depth, progress)
    method = ("trained once on whole shards read here; each part read its own shards from the store and added "
              "them with their faiss ids on the runner; merged (faiss merge_from)")
    return Built(index, IdMapFile().number(live.ordered), truth, live.snapshot, times, used, method, drift,
                 encoded_by, decoded_by)


def splits_by_store(choice: IndexChoice, parts: int) -> bool:
    """Parts that read their own shards: an IVF index without a re-rank, asked for in more than one part."""
    return parts > 1 and "IVF" in choice.factory and not refines(choice.factory)


def fill_and_tune(config, model: dict, live: LiveShards, choice: IndexChoice) -> tuple[Built, Tuned]:
    """Train, fill (streamed, or in parts that read their own shards) and tune one index (`config`: the
    build's IndexConfig)."""
    progress, depth = AddProgress(model["slug"], len(live)), TRUTH_DEPTH_PER_K * config.k
    if splits_by_store(choice, config.parts):
        built = build_from_store_parts(config.store, model, live, choice, config.parts, config.runner,
                                       config.workers, config.queries, depth, progress)
    else:
        built = build_streamed(config.store, model, live, choice, config.parts, config.runner, config.workers,
                               config.queries, depth, progress)
    return built, tune_task(built.index, quote(built.truth), config.target_recall, config.k)


@task(name="index-card", cache_policy=NO_CACHE)
def card_task(model: dict, built: Built, choice: IndexChoice, memory: str, tuned: Tuned, retrain_share: float,
              why: str, runner: str, disk: str) -> dict:
    card = make_card(model, len(built.ids), int(model["dim"]), built.snapshot, choice, memory, built.times, tuned,
                     built_lineage(len(built.ids), tuned.param, retrain_share, why), built.index, disk,
                     built.encoded_by, built.decoded_by)
    card["build"] = {"parts": built.parts, "runner": runner if runner in ("local", "dask") else "dask (remote)",
                     "method": built.method}
    return card


@task(name="write-drift-reference", cache_policy=NO_CACHE, **IO_RETRIES)
def write_reference_task(store_url: str, card: dict, ref: Reference) -> None:
    write_reference(Location(store_url), card["slug"], card["version"], ref)


@task(name="previous-version", cache_policy=NO_CACHE, **IO_RETRIES)
def previous_version_task(store_url: str, slug: str) -> dict | None:
    return previous_version(Location(store_url), slug)


@task(name="choose-index", cache_policy=NO_CACHE)
def choose_index_task(n: int, d: int, memory: str, kind: str, disk: str, previous: dict | None = None) -> IndexChoice:
    """The rule's choice (tasks/index/choice.py), or the previous version's fallback kind while it holds."""
    if kind == "auto":
        kept = kept_fallback(previous, n, d, memory, disk)
        if kept is not None:
            return kept
    return choose_index(n, d, memory, kind, disk)


@task(name="choose-fallback", cache_policy=NO_CACHE)
def fallback_task(choice: IndexChoice, n: int, d: int, memory: str, disk: str, tuned: Tuned) -> IndexChoice:
    return nightly_fallback(choice, n, d, memory, disk, tuned.recall, tuned.target)


def build_key(inputs: dict) -> str:
    """What determines an index: the model's live state, the choice and tuning parameters, the code."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def reusable_version(store: Location, slug: str, key: str) -> dict | None:
    """The card of the version built for `key`, when it is still complete with the checksum recorded.

    The record is plain JSON that imgest reads itself (never a serialised object: nothing read from a store
    is unpickled); an unreadable or foreign record is a cache miss, so the index is built again."""
    try:
        record = json.loads(store.read_bytes(build_record_key(slug, key)))
        version, sha256 = int(record["version"]), str(record["sha256"])
    except (FileNotFoundError, ValueError, TypeError, KeyError):
        return None
    card = {"slug": slug, "version": version, "sha256": sha256}
    return read_card(store, slug, version) if version_exists(store, card) else None


def record_build(store: Location, slug: str, key: str, inputs: dict, card: dict, fence: Fence | None = None) -> None:
    if fence is not None:
        fence.check(store)
    store.write_json(build_record_key(slug, key), {"version": card["version"], "sha256": card["sha256"],
                                                   "inputs": inputs, "created": card["created"]})
