"""A full index build streamed from the store, shard by shard: the live set numbered on disk (item_id order,
as an update numbers it), the training sample drawn by whole shards, then each shard read once and added to the
trained IVF index with its faiss ids (each inverted list allocated once at its length: tasks/index/lists.py), or
written into a memory map for the kinds that need every vector at once (HNSW, flat, a PQ index with re-rank
vectors). The probes' exact neighbours are found as the shards pass; the id map goes from DuckDB to a file. What
stays in memory is the index (without its re-rank vectors when they are kept on disk), one block of vectors and a
few int64 arrays of the shards' sizes: no object per item, and no copy of the catalogue's vectors for an IVF
kind; the training sample is let go once trained."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from imgest.retrieval.topk import keep_best
from imgest.retrieval.versions import IdMapFile
from imgest.state.drift import Reference, reference
from imgest.state.live import LiveShards, read_shard_vectors, vector_array
from imgest.storage import Location
from imgest.tasks.index.build import add_in_blocks, train
from imgest.tasks.index.choice import IndexChoice, refines
from imgest.tasks.index.lists import SizedAdd
from imgest.tasks.index.parts import merge_truth
from imgest.tasks.index.rerank import add_on_disk
from imgest.tasks.index.truth import Truth
from imgest.tasks.index.update import rename_ids
from imgest.timing import Stopwatch

ADD_BLOCK = 65_536  # vectors gathered from consecutive shards before one faiss add (and one probe scan)


def adds_by_shard(choice: IndexChoice) -> bool:
    """IVF codes take vectors with their ids in any order; a graph, a flat index and re-rank vectors (numbered by
    row) need them in faiss id order, all present: those go through a memory map."""
    return "IVF" in choice.factory and not refines(choice.factory)


def training_shards(counts: pa.Table, size: int, seed: int = 0) -> list[str]:
    """Whole shards in a seeded random order until they hold `size` live rows (all shards when size is 0 or
    beyond the catalogue): a build reads a few shards for its sample, not one row from each."""
    names, rows = counts["shard"].to_pylist(), counts["rows"].to_numpy()
    if size <= 0 or size >= rows.sum():
        return names
    order = np.random.default_rng(seed).permutation(len(names))
    taken = order[:int(np.searchsorted(np.cumsum(rows[order]), size)) + 1]
    return [names[i] for i in np.sort(taken)]


@dataclass
class Sample:
    """The training rows and the recall probes among them, read before the pass over every shard."""

    rows: np.ndarray  # faiss ids (positions in item_id order), sorted
    vectors: np.ndarray  # (len(rows), d) float32

    def probes(self, count: int, seed: int = 0) -> np.ndarray:
        """Positions in `rows` of a seeded sample of `count` of them (seeded)."""
        rng = np.random.default_rng(seed + 1)
        return np.sort(rng.choice(len(self.rows), size=min(count, len(self.rows)), replace=False))


def read_sample(store: Location, slug: str, dim: int, live: LiveShards, size: int, seed: int = 0) -> Sample:
    """`size` rows (all of them when fewer) from whole shards drawn by `training_shards`, with their vectors:
    each shard's written into place in one array (row order), so the sample is held once, not gathered and
    sorted in copies."""
    chosen = live.shard_rows(training_shards(live.counts, size, seed)).sort_by("row")
    if size and len(chosen) > size:  # the whole shards' surplus dropped before any vector is read: the sample is
        # never held twice (trimming it after reading copied 1.6M vectors beside themselves at 10M: +0.3 GB)
        chosen = chosen.take(pa.array(np.sort(np.random.default_rng(seed).choice(len(chosen), size=size,
                                                                                 replace=False))))
    rows = chosen["row"].to_numpy()
    vectors = np.empty((len(chosen), dim), np.float32)
    present = np.zeros(len(chosen), bool)
    shards = pc.dictionary_encode(chosen["shard"].combine_chunks())
    codes = shards.indices.to_numpy(zero_copy_only=False)
    by_shard = np.argsort(codes, kind="stable")  # each shard's positions together, in row order
    bounds = np.searchsorted(codes[by_shard], np.arange(len(shards.dictionary) + 1))
    for code, shard in enumerate(shards.dictionary.to_pylist()):  # one name per shard in the sample
        at = by_shard[bounds[code]:bounds[code + 1]]
        got, found = read_shard_vectors(store, slug, dim, shard, chosen["item_id"].take(at).combine_chunks())
        vectors[at[found]] = got
        present[at[found]] = True
    if not present.all():  # a live item without its row in its shard: left out of the sample
        rows, vectors = rows[present], vectors[present]
    return Sample(rows, vectors)


class TruthScan:
    """The probes' exact `depth` nearest neighbours, found block by block as the vectors pass: each block's best
    depth + 1 kept with the best so far (the probe's own row is dropped at the end)."""

    def __init__(self, probes: np.ndarray, probe_ids: np.ndarray, depth: int):
        self.probes, self.probe_ids, self.depth = np.ascontiguousarray(probes, np.float32), probe_ids, depth
        self.scores = np.full((len(probes), 0), -np.inf, np.float32)
        self.ids = np.full((len(probes), 0), -1, np.int64)

    def add(self, vectors: np.ndarray, ids: np.ndarray) -> None:
        import faiss

        if not len(vectors) or not len(self.probes):
            return
        scores, local = faiss.knn(self.probes, vectors, min(self.depth + 1, len(vectors)),
                                  metric=faiss.METRIC_INNER_PRODUCT)
        self.scores, self.ids = keep_best(self.scores, self.ids, scores,
                                          np.where(local >= 0, ids[np.clip(local, 0, None)], -1), self.depth + 1)

    def truth(self, n: int) -> Truth:
        return merge_truth(self.probes, self.probe_ids, [{"scores": self.scores, "ids": self.ids}], n, self.depth)


def _renumber(ids: np.ndarray, missing: np.ndarray) -> np.ndarray:
    """Faiss ids after the `missing` rows (sorted) leave: each id moves down by the missing rows before it."""
    return np.where(ids >= 0, ids - np.searchsorted(missing, ids), ids)


@dataclass
class Streamed:
    index: object
    ids: IdMapFile
    truth: Truth
    reference: Reference | None  # drawn from the training vectors (what later nights' drift is measured against)
    train_seconds: float
    add_seconds: float
    encoded_by: dict[str, int]  # indexed rows per "runtime precision", counted a shard at a time as it was read
    decoded_by: dict[str, int]  # and per JPEG decoder that made them


def _blocks(store: Location, slug: str, dim: int, live: LiveShards, missing: list[np.ndarray], encoded_by: Counter,
            decoded_by: Counter):
    """(vectors, faiss ids) of consecutive shards, about ADD_BLOCK rows at a time; the rows a shard lacks go to
    `missing` (a live item without its row is indexed without it, and said), the rows read to `encoded_by` and
    `decoded_by`."""
    held, held_ids, size = [], [], 0
    for shard, keep, rows in live:
        vectors, found = read_shard_vectors(store, slug, dim, shard, keep, encoded_by, decoded_by)
        if len(found) < len(rows):
            missing.append(np.setdiff1d(rows, rows[found]))
        held.append(vectors)
        held_ids.append(rows[found])
        size += len(found)
        if size >= ADD_BLOCK:
            yield np.concatenate(held), np.concatenate(held_ids)
            held, held_ids, size = [], [], 0
    if held:
        yield np.concatenate(held), np.concatenate(held_ids)


def stream_build(store: Location, slug: str, dim: int, live: LiveShards, choice: IndexChoice, queries: int,
                 depth: int, on_added: Callable[[int], None] | None = None,
                 add_parts: Callable | None = None) -> Streamed:
    """Train on a sample of whole shards, then pass over every shard once (see the module doc). `add_parts`,
    for the kinds built from a memory map: (vectors, choice, rows) -> (index, times, parts), to add in parallel
    parts instead of here."""
    sample = read_sample(store, slug, dim, live, choice.train_size)
    at = sample.probes(queries)
    scan = TruthScan(sample.vectors[at], sample.rows[at], depth)
    drift = reference(sample.vectors)
    missing: list[np.ndarray] = []
    encoded_by: Counter = Counter()
    decoded_by: Counter = Counter()
    training, adding = Stopwatch(running=False), Stopwatch(running=False)
    if adds_by_shard(choice):
        with training:
            index = train(sample.vectors, choice, rows=np.arange(len(sample.rows)))
        # trained: not held beside the index as it fills (0.3 GB at 10M). A new empty array, not `[:0]`: a slice is
        # a view that keeps the whole sample alive (it did, measured 2026-12-06: 304 MB through the 10M add)
        sample.vectors = np.empty((0, dim), np.float32)
        with adding:
            done, sized = 0, SizedAdd(index)
            for vectors, ids in _blocks(store, slug, dim, live, missing, encoded_by, decoded_by):
                sized.add(vectors, ids)
                scan.add(vectors, ids)
                done += len(ids)
                if on_added is not None:
                    on_added(done)
            index = sized.fill()
        gone = np.sort(np.concatenate(missing)) if missing else np.empty(0, np.int64)
        if len(gone):  # their ids were given out: the others move down to number 0..n-1
            rename_ids(index, _renumber(np.arange(len(live)), gone))
    else:
        sample.vectors = np.empty((0, dim), np.float32)  # these kinds train from the memory map's rows
        with adding:
            vectors = vector_array(len(live), dim)
            for block, ids in _blocks(store, slug, dim, live, missing, encoded_by, decoded_by):
                vectors[ids] = block
                scan.add(block, ids)
            gone = np.sort(np.concatenate(missing)) if missing else np.empty(0, np.int64)
            vectors = _close_gaps(vectors, gone)
        rows = _renumber(sample.rows, gone)
        if choice.refine == "disk":  # its re-rank vectors go to their file, never all in RAM
            with training:
                index = train(vectors, choice, rows=rows)
            with adding:
                index = add_on_disk(index, vectors, on_added)
            return _finish(slug, live, index, gone, scan, drift, training.seconds, adding.seconds, encoded_by,
                           decoded_by)
        if add_parts is not None:
            index, times, _ = add_parts(vectors, choice, rows)
            return _finish(slug, live, index, gone, scan, drift, times.train_seconds,
                           adding.seconds + times.add_seconds, encoded_by, decoded_by)
        with training:
            index = train(vectors, choice, rows=rows)
        with adding:
            add_in_blocks(index, vectors, on_added=on_added)
    return _finish(slug, live, index, gone, scan, drift, training.seconds, adding.seconds, encoded_by, decoded_by)


def _finish(slug: str, live: LiveShards, index, gone: np.ndarray, scan: TruthScan, drift: Reference | None,
            train_seconds: float, add_seconds: float, encoded_by: Counter, decoded_by: Counter) -> Streamed:
    """The id map without the rows that were missing, the probes' lists numbered as the index is."""
    n = len(live) - len(gone)
    if len(gone):
        logging.getLogger("imgest").warning("model=%s: %d live item(s) have no row in their shard; indexing the "
                                            "other %d", slug, len(gone), n)
        scan.ids, scan.probe_ids = _renumber(scan.ids, gone), _renumber(scan.probe_ids, gone)
    ids = IdMapFile().number(live.ordered, gone)
    if index.ntotal != n or ids.rows != n:
        raise RuntimeError(f"streamed build holds {index.ntotal} vectors and {ids.rows} ids for {n} live items")
    return Streamed(index, ids, scan.truth(n), drift, train_seconds, add_seconds, dict(encoded_by),
                    dict(decoded_by))


def _close_gaps(vectors: np.ndarray, gone: np.ndarray) -> np.ndarray:
    """The rows of `vectors` not in `gone`, moved down in place a block at a time (rows only move down)."""
    if not len(gone):
        return vectors
    kept = np.setdiff1d(np.arange(len(vectors)), gone)
    for begin in range(0, len(kept), ADD_BLOCK):
        part = kept[begin:begin + ADD_BLOCK]
        vectors[begin:begin + len(part)] = vectors[part]
    return vectors[:len(kept)]
