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

from imgest.retrieval.params import refine_of
from imgest.retrieval.versions import IdMapFile, IndexIntegrityError
from imgest.state.committed import LIVE, CatalogueState, shard_run_id
from imgest.state.layout import shard_key
from imgest.state.live import read_vectors
from imgest.state.rows import SORT_MEMORY, one_thread, sql_string
from imgest.state.shards import UNRECORDED, shard_decoder, shard_encoder
from imgest.storage import Location
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


def _write_id_map(cur, ids: IdMapFile) -> None:
    """The live items the index will hold (the view `live` less the table `missing`), numbered as a fresh build
    numbers them (faiss id = position in item_id order): DuckDB's external sort writes them to a file, which is
    then numbered batch by batch into the id map."""
    sorted_path = os.path.join(os.path.dirname(ids.path), "sorted.parquet")
    with one_thread(cur):
        cur.execute(f"""COPY (SELECT item_id, uri, hash AS content_hash, shard FROM live l
                              WHERE NOT EXISTS (SELECT 1 FROM missing m WHERE m.item_id = l.item_id)
                              ORDER BY item_id) TO {sql_string(sorted_path)} (FORMAT parquet)""")
    ids.number(sorted_path)
    os.remove(sorted_path)


def plan_delta(store: Location, slug: str, dim: int, previous_ids: str, state: CatalogueState) -> Delta:
    """What differs between the vectors in the previous version (its id map, a Parquet file on local disk) and
    the live state, new vectors read. Joined in the state's DuckDB (memory capped, spilling), the new id map
    written from there to a file: what comes into memory is the change and one int64 per previous vector. One
    thread (one set of buffers beside the index the update holds), under SORT_MEMORY (256 MB) up to
    SMALL_DELTA_ROWS previous vectors and the state's 512 MB above: DuckDB fills the cap it is given, and the 1M
    night's index update peaked at 927 MB under 256 MB and 1,084 MB under 512 (2026-12-06), while the join of
    two 10M id maps ran out of memory under 256 MB."""
    import duckdb

    ids = IdMapFile()
    try:
        previous_rows = pq.read_metadata(previous_ids).num_rows
    except (OSError, pa.ArrowException) as exc:
        raise IndexIntegrityError(f"the previous version's id map does not read as one: {exc}") from exc
    memory = SORT_MEMORY if previous_rows <= SMALL_DELTA_ROWS else None
    with state.sql() as cur, one_thread(cur, memory):
        try:
            cur.execute(f"""CREATE TEMP VIEW prev AS SELECT CAST(faiss_id AS BIGINT) AS faiss_id,
                            CAST(item_id AS VARCHAR) AS item_id, coalesce(CAST(content_hash AS VARCHAR), '') AS hash
                            FROM read_parquet({sql_string(previous_ids)})""")
            n, low, high, distinct = cur.execute(
                "SELECT count(*), min(faiss_id), max(faiss_id), count(DISTINCT faiss_id) FROM prev").fetchone()
        except duckdb.Error as exc:
            raise IndexIntegrityError(f"the previous version's id map does not read as one: {exc}") from exc
        if n and (low, high, distinct) != (0, n - 1, n):
            raise IndexIntegrityError(f"the previous version's id map numbers {n} vectors {low}..{high} with "
                                      f"{distinct} distinct ids, not 0..{n - 1}")
        cur.execute(f"""CREATE TEMP VIEW live AS SELECT item_id, uri, coalesce(content_hash, '') AS hash, shard
                        FROM state WHERE status = '{LIVE}'""")
        # an item is the same vector only with the same content: a changed item leaves and comes back
        fresh = cur.sql("""SELECT l.item_id, l.shard FROM live l ANTI JOIN prev p
                           ON p.item_id = l.item_id AND p.hash = l.hash ORDER BY l.item_id""").to_arrow_table()
        found, vectors = read_vectors(store, slug, dim, fresh)
        missing = fresh.filter(pc.invert(pc.is_in(fresh["item_id"], value_set=found["item_id"])))["item_id"]
        if len(missing):  # a live item without its row: index what is there, say what is not
            logging.getLogger("imgest").warning("model=%s: %d live item(s) have no row in their shard (e.g. %s); "
                                                "indexing the others", slug, len(missing), missing[:3].to_pylist())
        cur.register("missing", pa.table({"item_id": missing}))
        cur.register("found", pa.table({"item_id": found["item_id"], "position": np.arange(len(found))}))
        _write_id_map(cur, ids)
        cur.execute(f"CREATE TEMP VIEW numbered AS SELECT * FROM read_parquet({sql_string(ids.path)})")
        remap = cur.execute("""SELECT coalesce(n.faiss_id, -1) AS new FROM prev p LEFT JOIN numbered n
                               ON n.item_id = p.item_id AND n.content_hash = p.hash ORDER BY p.faiss_id""").fetchnumpy()
        added = cur.execute("""SELECT n.faiss_id FROM found f JOIN numbered n ON n.item_id = f.item_id
                               ORDER BY f.position""").fetchnumpy()
        by_shard = cur.sql("SELECT shard, count(*) AS rows FROM numbered GROUP BY shard ORDER BY shard"
                           ).to_arrow_table()
    return Delta(ids, np.asarray(remap["new"], np.int64), np.asarray(added["faiss_id"], np.int64), vectors, by_shard)


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
