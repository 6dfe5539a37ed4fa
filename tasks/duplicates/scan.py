"""The items that may have a duplicate, found without holding the catalogue: every live vector searched against
the served index a shard at a time, the pairs over a floor written to a scratch Parquet file as they are found,
then joined in DuckDB with the live set (on disk) for both items' content hashes and uris. Exact copies are the
live rows whose content hash another live row shares, grouped in DuckDB too. What reaches Python is the items
that have a duplicate or a candidate pair, never one object per catalogue item."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from imgest.state.live import LiveShards, read_shard_vectors
from imgest.state.rows import sql_string
from imgest.storage import Location

PAIRS_SCHEMA = pa.schema([("a", pa.string()), ("b", pa.string()), ("score", pa.float32())])


def scan_pairs(store: Location, slug: str, dim: int, live: LiveShards, opened, floor: float, k: int,
               on_done: Callable[[int], None] | None = None) -> str:
    """Each live item's `k` nearest in `opened` (the served index), shard by shard; the pairs (item, neighbour,
    cosine) scoring at least `floor` go to a Parquet file in the live set's folder, whose path is returned.
    `on_done(n)`: n live items searched so far."""
    path = os.path.join(live.folder, "pairs.parquet")
    done = 0
    with pq.ParquetWriter(path, PAIRS_SCHEMA) as writer:
        for shard, keep, _ in live:
            vectors, found = read_shard_vectors(store, slug, dim, shard, keep)
            if len(found):
                scores, ids = opened.search(vectors, k)
                near = (ids >= 0) & (scores >= floor)
                query = np.nonzero(near)[0]
                pairs = pa.table({"a": keep.take(pa.array(found[query])),
                                  "b": opened.ids.take_array(opened.item_ids, ids[near]),
                                  "score": pa.array(scores[near], pa.float32())}, schema=PAIRS_SCHEMA)
                writer.write_table(pairs.filter(pc.not_equal(pairs["a"], pairs["b"])))
            done += len(keep)
            if on_done is not None:
                on_done(done)
    return path


@dataclass
class Candidates:
    """What grouping needs: the items with a duplicate or a candidate pair, and the pairs."""

    hashes: dict[str, str]  # item -> content hash (every item in an exact group or a pair)
    uris: dict[str, str]  # item -> uri (the same items)
    pairs: list[tuple[str, str, float]]  # (a, b, cosine), a < b, both live, different bytes, best score of the two


def candidates(live: LiveShards, pairs_path: str) -> Candidates:
    """Exact copies and the scanned pairs joined with the live set (a neighbour gone since the index was built
    drops out; a pair of equal bytes is left to the exact groups)."""
    with live.connect() as con:
        exact = con.sql("""SELECT item_id, uri, content_hash FROM live WHERE content_hash IN (
                               SELECT content_hash FROM live GROUP BY content_hash HAVING count(*) > 1)
                           """).to_arrow_table()
        pairs = con.sql(f"""
            SELECT p.a, p.b, p.score, la.content_hash AS ha, lb.content_hash AS hb, la.uri AS ua, lb.uri AS ub
            FROM (SELECT least(a, b) AS a, greatest(a, b) AS b, max(score) AS score
                  FROM read_parquet({sql_string(pairs_path)}) GROUP BY 1, 2) AS p
            JOIN live AS la ON la.item_id = p.a JOIN live AS lb ON lb.item_id = p.b
            WHERE la.content_hash <> lb.content_hash ORDER BY p.a, p.b""").to_arrow_table()
    hashes = dict(zip(exact["item_id"].to_pylist(), exact["content_hash"].to_pylist()))
    uris = dict(zip(exact["item_id"].to_pylist(), exact["uri"].to_pylist()))
    a, b = pairs["a"].to_pylist(), pairs["b"].to_pylist()
    for side, items in (("a", a), ("b", b)):
        hashes.update(zip(items, pairs[f"h{side}"].to_pylist()))
        uris.update(zip(items, pairs[f"u{side}"].to_pylist()))
    return Candidates(hashes, uris, list(zip(a, b, pairs["score"].to_pylist())))
