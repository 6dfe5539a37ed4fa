"""Carry an IVF index version forward to the catalogue's live state: remove the vectors that left or changed,
add the new ones (faiss remove_ids / add_with_ids), keep faiss id = position in item_id order, and say when
the trained quantizer no longer represents the catalogue, so that the version is trained again instead.

Only the new vectors are read from the store; the previous version's id map says which vectors it holds.
A re-ranking index (PQ codes + float16 vectors, faiss IndexRefine) is updated the same way: its IVF part as
above, and its re-rank vectors, which faiss numbers by row, rewritten in the new id order (the kept ones'
float16 codes copied, the new ones encoded): in RAM when they are served from RAM, else from the mapped old
file into a new one, a block of rows at a time (tasks/index/rerank.py).
HNSW is rebuilt: its graph cannot drop a vector (faiss marks nothing deleted in an HNSW), and searching it with
deleted ids filtered out loses recall silently as deletions accumulate around the entry points. Flat indexes
have no training to save: they are rebuilt too (a copy of the vectors, the cost of reading them).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from imgest.retrieval.idmap import ID_MAP_BATCH, NotInOrder, merged_remap
from imgest.retrieval.params import refine_of
from imgest.retrieval.versions import IdMapFile, IndexIntegrityError
from imgest.state.committed import LIVE, CatalogueState, shard_run_id
from imgest.state.layout import shard_key
from imgest.state.live import read_vectors
from imgest.state.rows import SORT_MEMORY, one_thread, sql_string
from imgest.state.shards import UNRECORDED, shard_decoder, shard_encoder
from imgest.storage import Location, parquet_reader
from imgest.tasks.index.rerank import emptied, on_disk, renumbered_blocks, write_mapped

SMALL_DELTA_ROWS = 4_000_000  # previous vectors up to which the delta's joins run under SORT_MEMORY (plan_delta)
RETRAIN_PARAM_GROWTH = 2  # retrain when an update needs more than twice the nprobe its training served


class NotUpdatable(Exception):
    """Why this build trains a new index instead of updating the last one (the card records the reason)."""


@dataclass
class Delta:
    ids: IdMapFile  # the new version's id map: faiss_id (= row), item_id, uri, content_hash; item_id order
    remap: np.ndarray  # previous faiss id -> new faiss id; -1: the vector left (item deleted or content changed)
    added_ids: np.ndarray  # new faiss ids of the added vectors
    added: np.ndarray  # (A, d) float32 their vectors
    by_shard: pa.Table | None = None  # (shard, rows) of the new id map: a row per shard, for `encoded_by`

    @property
    def removed(self) -> int:
        return int((self.remap < 0).sum())


def plan_delta(store: Location, slug: str, dim: int, previous_ids: str, state: CatalogueState) -> Delta:
    """What differs between the vectors in the previous version (its id map, a Parquet file on local disk) and
    the live state, new vectors read. The live items are written in item_id order by DuckDB's external sort (one
    thread, under SORT_MEMORY up to SMALL_DELTA_ROWS previous vectors and the state's 512 MB above: DuckDB fills
    the cap it is given), then merged with the previous map, which is in the same order (`merged_remap`): no join
    of N rows by N, which ran out of memory at 10M items under 256 MB. What comes into memory is the change and
    one int64 per previous vector and per live item; the new id map is numbered from the sorted file, less the
    live items whose row is missing from their shard."""
    ids = IdMapFile()
    try:
        previous_rows = pq.read_metadata(previous_ids).num_rows
    except (OSError, pa.ArrowException) as exc:
        raise IndexIntegrityError(f"the previous version's id map does not read as one: {exc}") from exc
    memory = SORT_MEMORY if previous_rows <= SMALL_DELTA_ROWS else None
    ordered = os.path.join(os.path.dirname(ids.path), "sorted.parquet")
    try:
        with state.sql() as cur, one_thread(cur, memory):
            n = _check_previous(cur, previous_ids)
            cur.execute(f"""COPY (SELECT item_id, uri, coalesce(content_hash, '') AS content_hash, shard
                                  FROM state WHERE status = '{LIVE}' ORDER BY item_id)
                            TO {sql_string(ordered)} (FORMAT parquet)""")
            try:  # previous faiss id -> its item's row in `ordered`, same content; -1: the vector left
                kept = merged_remap(previous_ids, ordered, n)
            except NotInOrder:  # a map written before maps were numbered in item_id order: joined instead
                kept = _joined_remap(cur, previous_ids, ordered)
        live = pq.read_metadata(ordered).num_rows
        carried = np.zeros(live, bool)
        carried[kept[kept >= 0]] = True
        fresh_rows = np.flatnonzero(~carried)  # an item is the same vector only with the same content
        fresh = _rows_at(ordered, fresh_rows, ["item_id", "shard"])
        found, vectors = read_vectors(store, slug, dim, fresh)
        present = pc.is_in(fresh["item_id"], value_set=found["item_id"]).to_numpy(zero_copy_only=False)
        if not present.all():  # a live item without its row: index what is there, say what is not
            missing = fresh["item_id"].filter(pa.array(~present))
            logging.getLogger("imgest").warning("model=%s: %d live item(s) have no row in their shard (e.g. %s); "
                                                "indexing the others", slug, len(missing), missing[:3].to_pylist())
        skip = fresh_rows[~present]
        ids.number(ordered, skip=skip)  # faiss id = row in `ordered` less the skipped rows before it
    finally:
        if os.path.exists(ordered):
            os.remove(ordered)
    remap = np.where(kept >= 0, kept - np.searchsorted(skip, kept), -1)
    at = pc.index_in(found["item_id"], value_set=fresh["item_id"]).to_numpy(zero_copy_only=False)
    added_rows = fresh_rows[at.astype(np.int64)]
    added_ids = added_rows - np.searchsorted(skip, added_rows)
    with state.sql() as cur:
        by_shard = cur.sql(f"""SELECT shard, count(*) AS rows FROM read_parquet({sql_string(ids.path)})
                               GROUP BY shard ORDER BY shard""").to_arrow_table()
    return Delta(ids, remap.astype(np.int64), added_ids.astype(np.int64), vectors, by_shard)


def _check_previous(cur, previous_ids: str) -> int:
    """The previous map's row count, its faiss ids checked to be 0..n-1 (IndexIntegrityError otherwise)."""
    import duckdb

    try:
        n, low, high, distinct = cur.execute(f"""SELECT count(*), min(faiss_id), max(faiss_id), count(DISTINCT faiss_id)
                                                 FROM read_parquet({sql_string(previous_ids)})""").fetchone()
    except duckdb.Error as exc:
        raise IndexIntegrityError(f"the previous version's id map does not read as one: {exc}") from exc
    if n and (low, high, distinct) != (0, n - 1, n):
        raise IndexIntegrityError(f"the previous version's id map numbers {n} vectors {low}..{high} with "
                                  f"{distinct} distinct ids, not 0..{n - 1}")
    return n


def _joined_remap(cur, previous_ids: str, ordered: str) -> np.ndarray:
    """`merged_remap` for a previous map not in item_id order: a join in DuckDB (memory capped, spilling)."""
    return np.asarray(cur.execute(f"""
        SELECT coalesce(o.file_row_number, -1) AS row
        FROM read_parquet({sql_string(previous_ids)}) p
        LEFT JOIN read_parquet({sql_string(ordered)}, file_row_number = true) o
        ON o.item_id = CAST(p.item_id AS VARCHAR) AND o.content_hash = coalesce(CAST(p.content_hash AS VARCHAR), '')
        ORDER BY p.faiss_id""").fetchnumpy()["row"], np.int64)


def _rows_at(path: str, rows: np.ndarray, columns: list[str]) -> pa.Table:
    """`columns` of the file's rows at `rows` (ascending), read a batch at a time."""
    parts, start = [], 0
    for batch in parquet_reader(path).iter_batches(ID_MAP_BATCH, columns=columns):
        lo, hi = np.searchsorted(rows, [start, start + len(batch)])
        if hi > lo:
            parts.append(pa.Table.from_batches([batch]).take(pa.array(rows[lo:hi] - start)))
        start += len(batch)
    if not parts:
        return pa.table({name: pa.array([], pa.string()) for name in columns})
    return pa.concat_tables(parts)


FOOTER_READS = 16  # shard footers read at once (on an object store, a small ranged GET each)


def made_by_shards(store: Location, slug: str, by_shard: pa.Table) -> tuple[dict[str, int], dict[str, int]]:
    """Rows per "runtime precision" of an updated version, and per JPEG decoder: the new id map's rows per shard,
    the labels from the shards' footers (Parquet metadata only, no vectors). Counted afresh from the live shards
    rather than carried from the previous card: the rows an update removes may sit in shards the ingest has
    deleted since. A run encodes every shard it writes one way (decided before its first shard), so the footers
    of a run's first and last shard stand for all of its shards, read once per run rather than once per shard
    (at 100M items, 50,000 shards against a few hundred runs); a run whose two footers differ has each read."""
    def labels(shard: str | None) -> tuple[str, str]:
        if shard is None:
            return UNRECORDED, UNRECORDED
        meta = store.read_parquet_metadata(shard_key(slug, shard))
        return shard_encoder(meta), shard_decoder(meta)

    shards, rows = by_shard["shard"].to_pylist(), by_shard["rows"].to_pylist()
    runs: dict[str | None, list[int]] = {}
    for at, shard in enumerate(shards):  # a row per shard (the id map's shards), never per item
        runs.setdefault(None if shard is None else shard_run_id(shard), []).append(at)
    ends = sorted({i for members in runs.values() for i in (members[0], members[-1])})
    with ThreadPoolExecutor(FOOTER_READS) as pool:
        read = dict(zip(ends, pool.map(labels, [shards[i] for i in ends])))
        mixed = [i for members in runs.values() if read[members[0]] != read[members[-1]] for i in members[1:-1]]
        read.update(zip(mixed, pool.map(labels, [shards[i] for i in mixed])))
    encoded, decoded = Counter(), Counter()
    for members in runs.values():
        for i in members:
            by, dec = read.get(i, read[members[0]])
            encoded[by] += rows[i]
            decoded[dec] += rows[i]
    return dict(encoded), dict(decoded)


def rename_ids(index, remap: np.ndarray) -> None:
    """Rewrite the ids stored in every inverted list through `remap` (the lists are in memory)."""
    import faiss

    invlists = faiss.extract_index_ivf(index).invlists
    if not isinstance(faiss.downcast_InvertedLists(invlists), faiss.ArrayInvertedLists):
        raise NotUpdatable(f"inverted lists of type {type(faiss.downcast_InvertedLists(invlists)).__name__} "
                           "cannot be renumbered in place")
    for list_no in range(invlists.nlist):
        size = invlists.list_size(list_no)
        if size:
            ids = faiss.rev_swig_ptr(invlists.get_ids(list_no), size)  # a writable view of the list's ids
            ids[:] = remap[ids]


def _renumber_refine_vectors(refine, delta: Delta) -> None:
    """Rewrite the re-rank vectors (row = faiss id) held in RAM in the new id order, as the on-disk update does
    (`renumbered_blocks`), into the same index."""
    import faiss

    vectors = faiss.downcast_index(refine.refine_index)
    if not isinstance(vectors, faiss.IndexFlatCodes):
        raise NotUpdatable(f"re-rank vectors of type {type(vectors).__name__} cannot be renumbered in place")
    new = np.concatenate(list(renumbered_blocks(refine, delta.remap, delta.ids.rows, delta.added_ids, delta.added)))
    vectors.reset()
    vectors.add_sa_codes(new)
    refine.ntotal = vectors.ntotal


def apply_delta(index, delta: Delta):
    """Remove, renumber, add: afterwards faiss id i is row i of `delta.ids`, as in a fresh build. Returns the
    index: `index` itself, or a new one when its re-rank vectors are on disk (rewritten into a new file)."""
    import faiss

    refine = refine_of(index)
    if refine is not None:  # the codes searched are the base index; the re-rank vectors follow its new ids
        apply_delta(refine.base_index, delta)
        if on_disk(refine):  # a new file, written a block of rows at a time from the mapped old one
            rows = delta.ids.rows
            return write_mapped(emptied(refine), rows,
                                renumbered_blocks(refine, delta.remap, rows, delta.added_ids, delta.added))
        _renumber_refine_vectors(refine, delta)
        return index

    removed = np.flatnonzero(delta.remap < 0).astype(np.int64)
    if len(removed):
        index.remove_ids(faiss.IDSelectorBatch(removed))
    rename_ids(index, delta.remap)
    if len(delta.added):
        index.add_with_ids(np.ascontiguousarray(delta.added, np.float32), delta.added_ids)
    if index.ntotal != delta.ids.rows:
        raise RuntimeError(f"updated index holds {index.ntotal} vectors, the live state {delta.ids.rows}")
    return index


def updatable(previous: dict | None, factory: str, has_truth: bool) -> None:
    """Raise NotUpdatable unless `previous` (a card) is an IVF version trained as `factory`, with its exact lists."""
    if previous is None:
        raise NotUpdatable("no previous version: trained from scratch")
    if previous["search"]["param"] != "nprobe":
        what = "an HNSW graph cannot remove vectors" if previous["search"]["param"] == "efSearch" else \
            "a flat index has no training to save"
        raise NotUpdatable(f"v{previous['version']:04d} is {previous['factory']}: {what}; built again")
    if previous["factory"] != factory:
        raise NotUpdatable(f"the rule now picks {factory} for this catalogue; v{previous['version']:04d} was "
                           f"trained as {previous['factory']}")
    if not has_truth:
        raise NotUpdatable(f"v{previous['version']:04d} has no exact neighbour lists to carry forward")


def built_lineage(n: int, served_param: int | None, retrain_share: float, why: str) -> dict:
    """A version trained from scratch (trained_in None: this version itself)."""
    return {"method": "build", "trained_in": None, "updated_from": None, "trained_n": n,
            "trained_param": served_param, "added": None, "removed": None, "added_since_training": 0,
            "removed_since_training": 0, "retrain_share": retrain_share, "why": why}


def updated_lineage(previous: dict, added: int, removed: int, retrain_share: float) -> dict:
    """A version carried forward from `previous` (a card): trained in which version, updated from which, counts."""
    before = previous.get("lineage") or {}
    return {"method": "update", "trained_in": before.get("trained_in") or previous["version"],
            "updated_from": previous["version"], "trained_n": before.get("trained_n") or previous["n"],
            "trained_param": before.get("trained_param") or previous["search"]["value"],
            "added": added, "removed": removed,
            "added_since_training": before.get("added_since_training", 0) + added,
            "removed_since_training": before.get("removed_since_training", 0) + removed,
            "retrain_share": retrain_share,
            "why": f"updated in place from v{previous['version']:04d}: {removed:,} removed, {added:,} added"}


def check_drift(line: dict) -> None:
    """Raise NotUpdatable when more than `retrain_share` of the trained count was added since training."""
    share = line["added_since_training"] / max(line["trained_n"], 1)
    if share > line["retrain_share"]:
        raise NotUpdatable(f"{line['added_since_training']:,} vectors added since training in "
                           f"v{line['trained_in']:04d}: {share:.0%} of the {line['trained_n']:,} it was trained "
                           f"on, over the retrain share {line['retrain_share']:.0%}")


def check_served(line: dict, tuned) -> None:
    """Raise NotUpdatable when the updated index misses the target, or needs much more search for it than when
    it was trained (the clustering no longer fits the catalogue)."""
    if not tuned.met:
        raise NotUpdatable(f"updated index reaches recall@{tuned.k} {tuned.recall} < target {tuned.target}")
    trained_param = line["trained_param"] or 1
    if tuned.param > RETRAIN_PARAM_GROWTH * trained_param:
        raise NotUpdatable(f"updated index needs nprobe {tuned.param} for the target, over {RETRAIN_PARAM_GROWTH}x "
                           f"the {trained_param} served when trained in v{line['trained_in']:04d}")
