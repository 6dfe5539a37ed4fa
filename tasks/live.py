"""Stream the live embeddings of one model, shard by shard, as the committed state says."""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from imgest.storage import Location
from tasks.state import (
    LIVE,
    CatalogueState,
    latest_snapshot_seq,
    list_commits,
    load_state,
    run_seq,
    shard_key,
    shard_run_id,
    snapshot_key,
)


def live_by_shard(state: CatalogueState) -> dict[str, set[str]]:
    by_shard: dict[str, set[str]] = defaultdict(set)
    for item in state.items.values():
        if item.status == LIVE:
            by_shard[item.shard].add(item.item_id)
    return by_shard


def iter_live_tables(store: Location, state: CatalogueState) -> Iterator[pa.Table]:
    """One filtered table per shard: only the rows that are an item's current embedding."""
    for shard, keep in sorted(live_by_shard(state).items()):
        table = store.read_table(shard_key(state.slug, shard))
        yield table.filter(pc.is_in(table["item_id"], value_set=pa.array(sorted(keep))))


@dataclass
class LiveVectors:
    item_ids: list[str]
    uris: list[str]
    content_hashes: list[str]
    vectors: np.ndarray  # (N, d) float32, L2-normalised
    snapshot: int

    def __len__(self) -> int:
        return len(self.item_ids)


def live_fingerprint(store: Location, slug: str) -> str:
    """What the live vectors of a model are made of, without reading them: the newest snapshot and the
    shard commits folded on top of it (see load_state). Equal fingerprints, equal live vectors."""
    seq = latest_snapshot_seq(store, slug)
    pending = sorted(s for s in list_commits(store, slug) if run_seq(shard_run_id(s)) > seq)
    run_id = ""
    if seq:
        run_id = store.read_parquet_metadata(snapshot_key(slug, seq)).get("imgest.run_id", "")
    return hashlib.sha256(json.dumps([slug, seq, run_id, pending]).encode()).hexdigest()


def load_live_vectors(store: Location, slug: str, dim: int) -> LiveVectors:
    """All live vectors of a model in item_id order (stable faiss ids across rebuilds of one state)."""
    state = load_state(store, slug)
    tables = list(iter_live_tables(store, state))
    if not tables:
        return LiveVectors([], [], [], np.zeros((0, dim), np.float32), state.seq)
    table = pa.concat_tables(tables).sort_by("item_id")
    flat = table["embedding"].combine_chunks().flatten().to_numpy(zero_copy_only=False)
    return LiveVectors(table["item_id"].to_pylist(), table["uri"].to_pylist(), table["content_hash"].to_pylist(),
                       np.ascontiguousarray(flat.reshape(-1, dim), dtype=np.float32), state.seq)
