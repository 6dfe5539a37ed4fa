"""The items that may have a duplicate, found without holding the catalogue: every live vector searched against
the served index a shard at a time, the pairs over a floor written to a scratch Parquet file as they are found,
then joined in DuckDB with the live set (on disk) for both items' content hashes and uris. Exact copies are the
live rows whose content hash another live row shares, found in DuckDB too, which numbers the items that have a
duplicate or a candidate pair. What reaches Python is integer arrays (those items' numbers, their content hashes'
numbers, the pairs by number); their strings stay on disk, never one object per item."""

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

NEIGHBOURS = 16  # candidates per item; a group larger than this still joins up through its members
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
    """What grouping needs, as columns: the items that share their bytes with another live item or are in a pair,
    numbered 0..n-1 in item_id order, and the pairs between them by number. The items' strings stay on disk
    (`items`, a Parquet file: code, item_id, uri, content_hash in code order); Python holds integer arrays."""

    items: str  # path of the items file
    hash_code: np.ndarray  # int32 per item: equal where the content hashes are equal
    a: np.ndarray  # int32 per pair, a < b (by item_id), both live, different bytes
    b: np.ndarray
    score: np.ndarray  # float32 per pair: the best cosine of the two directions

    def __len__(self) -> int:
        return len(self.hash_code)

    def rows(self, codes: np.ndarray, folder: str) -> pa.Table:
        """(code, item_id, uri, content_hash) of `codes` (a few: the hash band's, a report's first groups), in
        code order."""
        from imgest.state.rows import scratch_sql

        with scratch_sql(folder) as con:
            con.register("wanted", pa.table({"code": pa.array(np.asarray(codes, np.int32))}))
            return con.sql(f"SELECT * FROM read_parquet({sql_string(self.items)}) SEMI JOIN wanted USING (code) "
                           "ORDER BY code").to_arrow_table()


def candidates(live: LiveShards, pairs_path: str) -> Candidates:
    """Exact copies and the scanned pairs joined with the live set in DuckDB (a neighbour gone since the index was
    built drops out; a pair of equal bytes is left to the exact groups), the items numbered there."""
    items = os.path.join(live.folder, "items.parquet")
    with live.connect() as con:
        con.execute(f"""CREATE TEMP TABLE pairs AS
            SELECT p.a, p.b, p.score FROM (SELECT least(a, b) AS a, greatest(a, b) AS b, max(score) AS score
                                           FROM read_parquet({sql_string(pairs_path)}) GROUP BY 1, 2) AS p
            JOIN live AS la ON la.item_id = p.a JOIN live AS lb ON lb.item_id = p.b
            WHERE la.content_hash <> lb.content_hash""")
        con.execute(f"""COPY (
            WITH shared AS (SELECT content_hash FROM live GROUP BY content_hash HAVING count(*) > 1),
                 wanted AS (SELECT item_id FROM live SEMI JOIN shared USING (content_hash)
                            UNION SELECT a FROM pairs UNION SELECT b FROM pairs)
            SELECT (row_number() OVER (ORDER BY item_id) - 1)::INTEGER AS code, item_id, uri, content_hash,
                   (dense_rank() OVER (ORDER BY content_hash) - 1)::INTEGER AS hash_code
            FROM live SEMI JOIN wanted USING (item_id) ORDER BY item_id
            ) TO {sql_string(items)} (FORMAT parquet, COMPRESSION zstd)""")
        coded = con.sql(f"""SELECT i.code AS a, j.code AS b, p.score FROM pairs AS p
                            JOIN read_parquet({sql_string(items)}) AS i ON i.item_id = p.a
                            JOIN read_parquet({sql_string(items)}) AS j ON j.item_id = p.b
                            ORDER BY 1, 2""").to_arrow_table()
    hash_code = pq.read_table(items, columns=["hash_code"])["hash_code"].to_numpy()
    return Candidates(items, hash_code, coded["a"].to_numpy(), coded["b"].to_numpy(),
                      coded["score"].to_numpy().astype(np.float32))
