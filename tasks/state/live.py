"""Stream the live embeddings of one model, shard by shard, as the committed state says."""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from imgest.storage import Location
from imgest.tasks.ingest.shards import embedding_matrix
from imgest.tasks.state.committed import (
    CatalogueState,
    latest_snapshot_key,
    latest_snapshot_seq,
    list_commits,
    load_state,
    run_seq,
    shard_key,
    shard_run_id,
)


def live_by_shard(live: pa.Table) -> list[tuple[str, pa.Array, np.ndarray]]:
    """(shard, item ids of its live rows, their rows in `live`) per shard, in shard order: columnar, no object
    per item. `live`: the live rows (item_id, shard) in the order their rows number them."""
    rows = np.arange(len(live))
    order = pc.sort_indices(live.select(["shard"]), sort_keys=[("shard", "ascending")])
    shards = live["shard"].combine_chunks().take(order)
    ids = live["item_id"].combine_chunks().take(order)
    positions = rows[order.to_numpy()]
    out, start = [], 0
    for run in pc.run_end_encode(shards).run_ends.to_pylist() if len(shards) else []:
        out.append((shards[start].as_py(), ids.slice(start, run - start), positions[start:run]))
        start = run
    return out


def _live_rows(store: Location, slug: str, shard: str, keep: pa.Array) -> tuple[pa.Table, np.ndarray]:
    """A shard's rows that are an item's current embedding, and where each is among `keep` (the shard's live
    ids): looked up in the shard's own ids, never in the whole catalogue's."""
    table = store.read_table(shard_key(slug, shard))
    table = table.filter(pc.is_in(table["item_id"], value_set=keep))
    return table, pc.index_in(table["item_id"], value_set=keep).to_numpy().astype(np.int64)


def iter_live_tables(store: Location, state: CatalogueState) -> Iterator[pa.Table]:
    """One filtered table per shard: only the rows that are an item's current embedding."""
    for shard, keep, _ in live_by_shard(state.live_table().select(["item_id", "shard"])):
        yield _live_rows(store, state.slug, shard, keep)[0]


@dataclass
class LiveVectors:
    item_ids: list[str]
    uris: list[str]
    content_hashes: list[str]
    vectors: np.ndarray  # (N, d) float32, L2-normalised
    snapshot: int
    shard_codes: np.ndarray | None = None  # (N,) which shard each row came from (a code per shard name)
    store_url: str = ""
    slug: str = ""
    catalogue: str | None = None  # the operator's catalogue for reading images, when the run has one
    _images: object = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.item_ids)

    def read_image(self, row: int) -> bytes:
        """The bytes of a row's image, read only under the model's catalogue root (a row's uri is a record:
        see tasks/state/catalogue_images.py)."""
        from imgest.tasks.state.catalogue_images import CatalogueImages

        if self._images is None:
            self._images = CatalogueImages(Location(self.store_url), self.slug, self.catalogue)
        return self._images.read(self.uris[row])


def live_fingerprint(store: Location, slug: str) -> str:
    """What the live vectors of a model are made of, without reading them: the newest snapshot and the
    shard commits folded on top of it (see load_state). Equal fingerprints, equal live vectors."""
    seq = latest_snapshot_seq(store, slug)
    pending = sorted(s for s in list_commits(store, slug) if run_seq(shard_run_id(s)) > seq)
    run_id = ""
    if seq:
        run_id = store.read_parquet_metadata(latest_snapshot_key(store, slug)).get("imgest.run_id", "")
    return hashlib.sha256(json.dumps([slug, seq, run_id, pending]).encode()).hexdigest()


# Live vectors larger than this go to an unlinked scratch file under TMPDIR (memory-mapped) instead of the
# heap: the build then holds one shard's table at a time plus the index it fills, and the OS pages the
# vectors in and out. faiss reads the memory map in place (add in blocks, exact search for tuning).
SPILL_BYTES = 256 << 20


def _vector_array(n: int, dim: int) -> np.ndarray:
    if n * dim * 4 < SPILL_BYTES:
        return np.empty((n, dim), np.float32)
    with tempfile.TemporaryFile(prefix="imgest-live-") as fh:  # already unlinked; the mapping keeps it
        fh.truncate(n * dim * 4)
        return np.memmap(fh, np.float32, "w+", shape=(n, dim))


def load_live_vectors(store: Location, slug: str, dim: int) -> LiveVectors:
    """All live vectors of a model in item_id order (stable faiss ids across rebuilds of one state), read
    one shard at a time and written into place (see SPILL_BYTES for where)."""
    state = load_state(store, slug)
    live = state.live_table()
    live_ids = live["item_id"].combine_chunks()  # item_id order: faiss id n is row n
    codes = pc.dictionary_encode(live["shard"].combine_chunks()).indices.to_numpy().astype(np.int32)
    item_ids = live_ids.to_pylist()
    vectors = _vector_array(len(item_ids), dim)
    uris: list[str | None] = [None] * len(item_ids)
    hashes: list[str | None] = [None] * len(item_ids)
    # each shard's rows are looked up among its own live ids (a lookup in all N ids per shard was N x shards:
    # an hour at 10M items in 5,000 shards)
    for shard, keep, positions in live_by_shard(live.select(["item_id", "shard"])):
        table, found = _live_rows(store, slug, shard, keep)
        rows = positions[found]
        vectors[rows] = embedding_matrix(table, dim)
        for row, uri, content_hash in zip(rows, table["uri"].to_pylist(), table["content_hash"].to_pylist()):
            uris[row], hashes[row] = uri, content_hash
    found = [n for n, uri in enumerate(uris) if uri is not None]
    if len(found) < len(item_ids):  # a live item without its row: index what is there, say what is not
        missing = [item_ids[n] for n, uri in enumerate(uris) if uri is None]
        logging.getLogger("imgest").warning("model=%s: %d live item(s) have no row in their shard (e.g. %s); "
                                            "indexing the other %d", slug, len(missing), missing[:3], len(found))
        item_ids, uris, hashes = [item_ids[n] for n in found], [uris[n] for n in found], [hashes[n] for n in found]
        vectors, codes = np.ascontiguousarray(vectors[found]), codes[found]
    return LiveVectors(item_ids, uris, hashes, vectors, state.seq, codes, store.url, slug)
