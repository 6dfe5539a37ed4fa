"""An item's stored embedding, read from the shard that holds it: the vector of a query by item id."""

from __future__ import annotations

import re
import threading
from collections import OrderedDict

import numpy as np
import pyarrow.compute as pc

from imgest.state.committed import LIVE, CatalogueState, load_state
from imgest.state.layout import shard_key
from imgest.state.shards import embedding_matrix
from imgest.storage import Location

MAX_ITEM_ID_CHARS = 1024


EXACT_FACTORY = re.compile(r"Flat|HNSW\d+(,Flat)?")  # indexes whose storage is the float vectors themselves


def stores_vectors(card: dict) -> bool:
    """Whether an index keeps its vectors uncompressed, so that `reconstruct` gives an item's own embedding
    (otherwise the shard holds the only exact copy)."""
    return bool(EXACT_FACTORY.fullmatch(str(card.get("factory", ""))))


class ItemNotFound(LookupError):
    """The item id names no live item of this model; the query is the request's fault."""


class StoredVectors:
    """Live embeddings of one model by item id, as the float vectors its shards hold (never an index's
    compressed codes, so a query by item id is the item's own embedding whatever the index kind).

    The committed state is read on the first lookup and kept (it maps an item to its shard); a lookup then
    reads one shard's `item_id` and `embedding` columns. The last `keep` vectors are kept. Thread-safe: a
    service answers several requests at once."""

    def __init__(self, store: Location, slug: str, dim: int, keep: int = 4096, ids=None):
        self.store, self.slug, self.dim, self.keep = store, slug, dim, keep
        self.ids = ids  # an index version's IdMap: the shard an indexed item's vector was read from
        self._state: CatalogueState | None = None
        self._vectors: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def vector(self, item_id: str) -> np.ndarray:
        if not isinstance(item_id, str) or not item_id or len(item_id) > MAX_ITEM_ID_CHARS:
            raise ItemNotFound(f"item_id must be a non-empty string of at most {MAX_ITEM_ID_CHARS} characters")
        with self._lock:
            if item_id in self._vectors:
                self._vectors.move_to_end(item_id)
                return self._vectors[item_id]
            vector = self._read(item_id)
            self._vectors[item_id] = vector
            while len(self._vectors) > self.keep:
                self._vectors.popitem(last=False)
            return vector

    def _read(self, item_id: str) -> np.ndarray:
        if self.ids is not None and self.ids.shards is not None and (at := self.ids.position(item_id)) is not None:
            vector = self._from_shard(item_id, self.ids.shard(at))  # no state to load: a binary search, one shard
            if vector is not None:
                return vector
        if self._state is None:
            self._state = load_state(self.store, self.slug)
        found = self._state.query("SELECT shard FROM state WHERE status = ? AND item_id = ?", [LIVE, item_id])
        if not found.num_rows:
            raise ItemNotFound(f"no live item {item_id!r} in model={self.slug}")
        shard = found.column("shard")[0].as_py()
        vector = self._from_shard(item_id, shard)
        if vector is None:  # the state names a shard without the row: the store is damaged, not the request
            raise ItemNotFound(f"item {item_id!r} of model={self.slug} has no row in its shard {shard}")
        return vector

    def _from_shard(self, item_id: str, shard: str) -> np.ndarray | None:
        """The item's row in `shard`; None when the shard is gone (cleaned up since) or lacks it."""
        try:
            table = self.store.read_table(shard_key(self.slug, shard), columns=["item_id", "embedding"])
        except FileNotFoundError:
            return None
        rows = table.filter(pc.equal(table.column("item_id"), item_id))
        return embedding_matrix(rows.slice(rows.num_rows - 1), self.dim)[0].copy() if rows.num_rows else None
