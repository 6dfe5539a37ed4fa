"""Stream the live embeddings of one model, shard by shard, as the committed state says."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from imgest.state.committed import (
    LIVE,
    CatalogueState,
    latest_snapshot_key,
    latest_snapshot_seq,
    list_commits,
    load_state,
    run_seq,
    shard_run_id,
)
from imgest.state.layout import shard_key
from imgest.state.shards import embedding_matrix, shard_decoder, shard_encoder
from imgest.storage import Location, parquet_reader


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


class LiveShards:
    """The live items of a state on local disk, numbered and grouped by shard, so that a pass over the whole
    catalogue holds one shard's ids at a time and no object per item:

      `ordered`   (item_id, uri, content_hash, shard) in item_id order: row r is the item numbered r, as an index
                  numbers its vectors (DuckDB's external sort writes it: memory capped, spilling);
      `by_shard`  (shard, item_id, row) sorted by shard then item_id: one read of it visits each shard once;
      `counts`    (shard, rows) per shard, in shard order: small (a row per shard).

    The files go with the object. Built from `state` in one pass; the state can be closed afterwards."""

    def __init__(self, state: CatalogueState) -> None:
        from imgest.scratch import scratch_folder
        from imgest.state.rows import SORT_MEMORY, one_thread, sql_string

        folder = self.folder = scratch_folder(self, "live")
        self.ordered = os.path.join(folder, "ordered.parquet")
        self.by_shard = os.path.join(folder, "by_shard.parquet")
        self.snapshot = state.seq
        numbered = os.path.join(folder, "numbered.parquet")
        with state.sql() as cur, one_thread(cur, SORT_MEMORY):  # wide rows: one sort's buffers, as a snapshot's
            cur.execute(f"""COPY (SELECT item_id, uri, content_hash, shard FROM state WHERE status = '{LIVE}'
                                  ORDER BY item_id) TO {sql_string(self.ordered)}
                            (FORMAT parquet, ROW_GROUP_SIZE {LIVE_BATCH})""")
            self.rows = 0
            with pq.ParquetWriter(numbered, BY_SHARD_SCHEMA) as writer:  # the row numbers, in order
                for batch in parquet_reader(self.ordered).iter_batches(LIVE_BATCH, columns=["shard", "item_id"]):
                    rows = pa.array(np.arange(self.rows, self.rows + len(batch)), pa.int64())
                    writer.write_batch(pa.record_batch([*batch.columns, rows], schema=BY_SHARD_SCHEMA))
                    self.rows += len(batch)
            cur.execute(f"""COPY (SELECT * FROM read_parquet({sql_string(numbered)}) ORDER BY shard, item_id)
                            TO {sql_string(self.by_shard)} (FORMAT parquet, ROW_GROUP_SIZE {LIVE_BATCH})""")
            self.counts = cur.sql(f"""SELECT shard, count(*) AS rows FROM read_parquet({sql_string(self.by_shard)})
                                      GROUP BY shard ORDER BY shard""").to_arrow_table()
        os.remove(numbered)

    def __len__(self) -> int:
        return self.rows

    def __iter__(self) -> Iterator[tuple[str, pa.Array, np.ndarray]]:
        """(shard, its live item ids, their rows) per shard, in shard order, read a batch at a time."""
        for group in shard_groups(self.by_shard):
            yield group["shard"][0].as_py(), group["item_id"].combine_chunks(), group["row"].to_numpy()

    def connect(self):
        """A DuckDB connection with the live rows as the view `live` (item_id, uri, content_hash, shard), capped
        as a state's and spilling to this live set's folder."""
        from imgest.state.rows import scratch_sql, sql_string

        con = scratch_sql(self.folder)
        con.execute(f"CREATE VIEW live AS SELECT * FROM read_parquet({sql_string(self.ordered)})")
        return con

    def rows_of(self, item_ids: pa.Array) -> pa.Table:
        """(item_id, uri, content_hash) of those of `item_ids` that are live, in item_id order (for a few ids: a
        sample's, its neighbours')."""
        with self.connect() as con:
            con.register("wanted", pa.table({"item_id": pa.array(item_ids, pa.string())}))
            return con.sql("SELECT item_id, uri, content_hash FROM live SEMI JOIN wanted USING (item_id) "
                           "ORDER BY item_id").to_arrow_table()

    def metadata_by_shard(self, snapshot: str) -> Iterator[pa.Table]:
        """The metadata rows of the live items, one table per shard in this set's order (shard, then item_id),
        row for row as the shard's live ids come (null where an item has no row): the live ids (`ordered`)
        merged with `snapshot` (a metadata snapshot's local Parquet file) a batch at a time, then sorted by shard
        by DuckDB on disk, capped and spilling, and read a batch at a time; no whole snapshot, no lookup among
        every key, no join of N rows by N."""
        from imgest.state.metadata import write_merged
        from imgest.state.rows import SORT_MEMORY, one_thread, sql_string

        merged, joined = (os.path.join(self.folder, f"metadata-{name}.parquet") for name in ("merged", "by-shard"))
        names = [n for n in pq.read_schema(snapshot).names if n not in ("item_id", "row_hash")]
        write_merged(snapshot, self.ordered, ["shard", "item_id"], names, merged, METADATA_BATCH)
        with self.connect() as con, one_thread(con, SORT_MEMORY):  # rows as wide as the metadata: one sort's buffers
            con.execute(f"""COPY (SELECT * FROM read_parquet({sql_string(merged)}) ORDER BY shard, item_id)
                            TO {sql_string(joined)} (FORMAT parquet, ROW_GROUP_SIZE {METADATA_BATCH})""")
        os.remove(merged)
        yield from (group.drop_columns(["shard", "item_id"]) for group in shard_groups(joined, METADATA_BATCH))

    def shard_rows(self, shards: list[str]) -> pa.Table:
        """(shard, item_id, row) of the live items in `shards` (a few of them: a training sample's)."""
        wanted = pa.array(shards, pa.string())
        tables = [pa.Table.from_batches([b]).filter(pc.is_in(b.column(0), value_set=wanted))
                  for b in parquet_reader(self.by_shard).iter_batches(LIVE_BATCH)]
        return pa.concat_tables(tables) if tables else BY_SHARD_SCHEMA.empty_table()


BY_SHARD_SCHEMA = pa.schema([("shard", pa.string()), ("item_id", pa.string()), ("row", pa.int64())])
LIVE_BATCH = 16_384  # rows of the live set read at a time (and its files' row groups: a read decodes one)
METADATA_BATCH = 4_096  # rows of joined metadata read at a time: a row is as wide as the catalogue's metadata


def shard_groups(path: str, batch_rows: int = LIVE_BATCH) -> Iterator[pa.Table]:
    """The rows of a Parquet file sorted by its `shard` column, one table per shard, read `batch_rows` at a
    time."""
    carry: list[pa.RecordBatch] = []
    for batch in parquet_reader(path).iter_batches(batch_rows):
        table = pa.Table.from_batches([*carry, batch]).combine_chunks()
        ends = pc.run_end_encode(table["shard"].combine_chunks()).run_ends.to_numpy()
        start = 0
        for end in ends[:-1]:  # the last run may go on in the next batch
            yield table.slice(start, end - start)
            start = int(end)
        carry = table.slice(start).to_batches()
    if carry and sum(len(b) for b in carry):
        yield pa.Table.from_batches(carry)


def read_shard_vectors(store: Location, slug: str, dim: int, shard: str, keep: pa.Array,
                       encoded_by: Counter | None = None,
                       decoded_by: Counter | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The vectors of a shard's live rows and where each is among `keep` (the shard's live ids); an id of `keep`
    without a row in the shard is not among the positions. With `encoded_by` (`decoded_by`), the rows read are
    counted under what encoded them (the JPEG decoder that made them), as the shard's own metadata says
    (`shard_encoder`, `shard_decoder`)."""
    table, found = _live_rows(store, slug, shard, keep)
    if encoded_by is not None:
        encoded_by[shard_encoder(table.schema.metadata)] += len(table)
    if decoded_by is not None:
        decoded_by[shard_decoder(table.schema.metadata)] += len(table)
    return embedding_matrix(table, dim), found


def _live_rows(store: Location, slug: str, shard: str, keep: pa.Array) -> tuple[pa.Table, np.ndarray]:
    """A shard's rows that are an item's current embedding, and where each is among `keep` (the shard's live
    ids): looked up in the shard's own ids, never in the whole catalogue's."""
    table = store.read_table(shard_key(slug, shard))
    table = table.filter(pc.is_in(table["item_id"], value_set=keep))
    return table, pc.index_in(table["item_id"], value_set=keep).to_numpy().astype(np.int64)


def iter_live_tables(store: Location, state: CatalogueState, metadata: str | None = None) -> Iterator[pa.Table]:
    """One filtered table per shard: only the rows that are an item's current embedding (the live set numbered
    on disk first: one shard's ids in memory at a time). With `metadata` (a snapshot's local Parquet file), each
    row carries its item's metadata columns (`LiveShards.metadata_by_shard`; null where it has none; a name the
    shard uses already is prefixed `metadata_`)."""
    live = LiveShards(state)
    groups = live.metadata_by_shard(metadata) if metadata else None
    for shard, keep, _ in live:
        table, found = _live_rows(store, state.slug, shard, keep)
        if groups is not None:
            rows = next(groups).take(pa.array(found, pa.int64()))  # the group's rows are `keep`'s, in its order
            for name in rows.column_names:
                table = table.append_column(f"metadata_{name}" if name in table.column_names else name, rows[name])
        yield table


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
    total: int | None = None  # live items of the model (more than these rows when they are a sample)
    encoded_by: dict[str, int] | None = None  # the rows read, per what encoded them ("openvino fp32": shard_encoder)
    _images: object = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.item_ids)

    def read_image(self, row: int) -> bytes:
        """The bytes of a row's image, read only under the model's catalogue root (a row's uri is a record:
        see imgest/state/catalogue_images.py)."""
        return self.read_uri(self.uris[row])

    def read_uri(self, uri: str) -> bytes:
        """The bytes of an image of this model's catalogue by its uri (another item's: a neighbour's)."""
        from imgest.state.catalogue_images import CatalogueImages

        if self._images is None:
            self._images = CatalogueImages(Location(self.store_url), self.slug, self.catalogue)
        return self._images.read(uri)


def live_fingerprint(store: Location, slug: str) -> str:
    """What the live vectors of a model are made of, without reading them: the newest snapshot and the
    shard commits folded on top of it (see load_state). Equal fingerprints, equal live vectors."""
    seq = latest_snapshot_seq(store, slug)
    pending = sorted(s for s in list_commits(store, slug) if run_seq(shard_run_id(s)) > seq)
    run_id = ""
    if seq:
        run_id = store.read_parquet_metadata(latest_snapshot_key(store, slug)).get("imgest.run_id", "")
    return hashlib.sha256(json.dumps([slug, seq, run_id, pending]).encode()).hexdigest()


# Live vectors larger than this go to an unlinked scratch file under TMPDIR (memory-mapped, `vector_array`), not the
# heap: the build then holds one shard's table at a time plus the index it fills, and the OS pages the
# vectors in and out. faiss reads the memory map in place (add in blocks, exact search for tuning).
SPILL_BYTES = 256 << 20


def vector_array(n: int, dim: int) -> np.ndarray:
    """(n, dim) float32 for vectors to be written in place: on the heap, or past SPILL_BYTES memory-mapped."""
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
    vectors = vector_array(len(item_ids), dim)
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


def sample_rows(n: int, limit: int, seed: int) -> np.ndarray:
    """A seeded sample of at most `limit` of `n` rows, in order: memory bounded whatever the catalogue's size."""
    if n <= limit:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=limit, replace=False))


def live_set(store: Location, slug: str) -> LiveShards:
    """The model's live items numbered on local disk, the state closed once they are."""
    state = load_state(store, slug)
    try:
        return LiveShards(state)
    finally:
        state.close()


def load_live_sample(store: Location, slug: str, dim: int, limit: int, seed: int) -> LiveVectors:
    """At most `limit` live vectors, a seeded sample of the rows in item_id order (`sample_rows`: the rows
    `load_live_vectors` would give at those positions), with their ids, uris and hashes; `total` says how many
    are live, `encoded_by` what encoded the rows read. Only the shards holding a sampled row are read, and only
    the sample is kept: memory follows `limit`, not the catalogue."""
    return live_sample(store, slug, dim, live_set(store, slug), limit, seed)


def live_sample(store: Location, slug: str, dim: int, live: LiveShards, limit: int, seed: int) -> LiveVectors:
    """`load_live_sample` from a live set already numbered."""
    wanted = sample_rows(len(live), limit, seed)
    parts: list[tuple[np.ndarray, pa.Table]] = []
    encoded_by: Counter = Counter()
    for shard, keep, rows in live:
        picked = np.isin(rows, wanted)
        if not picked.any():
            continue
        table, found = _live_rows(store, slug, shard, keep.filter(pa.array(picked)))
        encoded_by[shard_encoder(table.schema.metadata)] += len(table)
        parts.append((rows[picked][found], table.select(["item_id", "uri", "content_hash", "embedding"])))
    if not parts:
        return LiveVectors([], [], [], np.empty((0, dim), np.float32), live.snapshot, None, store.url, slug,
                           total=len(live), encoded_by={})
    rows = np.concatenate([r for r, _ in parts])
    table = pa.concat_tables([t for _, t in parts]).take(pa.array(np.argsort(rows, kind="stable")))
    if len(table) < len(wanted):
        logging.getLogger("imgest").warning("model=%s: %d sampled live item(s) have no row in their shard",
                                            slug, len(wanted) - len(table))
    return LiveVectors(table["item_id"].to_pylist(), table["uri"].to_pylist(), table["content_hash"].to_pylist(),
                       np.ascontiguousarray(embedding_matrix(table, dim)), live.snapshot, None, store.url, slug,
                       total=len(live), encoded_by=dict(encoded_by))


def read_vectors(store: Location, slug: str, dim: int, wanted: pa.Table, encoded_by: Counter | None = None,
                 decoded_by: Counter | None = None) -> tuple[pa.Table, np.ndarray]:
    """The rows of `wanted` (item_id, shard) found in their shards, with their vectors; only those shards read.
    With `encoded_by` (`decoded_by`), the rows found are counted under what encoded them (`shard_encoder`) and
    the JPEG decoder that made them (`shard_decoder`)."""
    wanted = wanted.select(["item_id", "shard"]).sort_by("shard")
    ids, start = wanted["item_id"].combine_chunks(), 0
    tables, vectors = [], []
    per_shard = pc.value_counts(wanted["shard"])  # in the sorted order: one entry per shard, never per row
    for shard, count in zip(per_shard.field("values").to_pylist(), per_shard.field("counts").to_pylist()):
        keep, start = ids.slice(start, count), start + count
        table = store.read_table(shard_key(slug, shard))
        table = table.filter(pc.is_in(table["item_id"], value_set=keep))
        if encoded_by is not None:
            encoded_by[shard_encoder(table.schema.metadata)] += len(table)
        if decoded_by is not None:
            decoded_by[shard_decoder(table.schema.metadata)] += len(table)
        tables.append(table.select(["item_id"]))
        vectors.append(embedding_matrix(table, dim))
    if not tables:
        return pa.table({"item_id": pa.array([], pa.string())}), np.empty((0, dim), np.float32)
    return pa.concat_tables(tables), np.concatenate(vectors).astype(np.float32, copy=False)


# -- a few of the live items, found by SQL in the state and read by shard: the whole live set is never loaded --
ROW_COLUMNS = "s.item_id, s.uri, s.content_hash, s.shard"


def live_rows_of(state: CatalogueState, wanted: pa.Table | str, columns: str = ROW_COLUMNS, at_most: int = 0,
                 seed: int = 0) -> pa.Table:
    """The live rows (`columns` of the state: item_id, uri, content_hash, shard by default) of the items in `wanted`
    (an Arrow table, or SQL for a relation such as a Parquet file: an `item_id` column, each id once, and any other
    columns, kept), in item_id order: a join in the state's database on one thread under SORT_MEMORY, no object per
    row. With `at_most`, at most that many of them: a seeded sample, drawn as the join streams (rows whose hash
    with the seed falls under a threshold), then trimmed to `at_most` (`live_count_of` says how many there are)."""
    from imgest.state.rows import SORT_MEMORY, one_thread

    with state.sql() as cur, one_thread(cur, SORT_MEMORY):
        source = _wanted(cur, wanted)
        others = [c for c in cur.sql(f"SELECT * FROM {source} LIMIT 0").columns if c != "item_id"]
        extra = "".join(f", w.{c}" for c in others)
        joined = f"FROM state s JOIN {source} w ON w.item_id = s.item_id WHERE s.status = '{LIVE}'"
        total = cur.execute(f"SELECT count(*) {joined}").fetchall()[0][0] if at_most else 0
        drawn = ""
        if at_most and total > at_most:  # a little over at_most pass; the trim below takes exactly at_most
            share = min(1.0, 1.02 * at_most / total + 64 / total)
            drawn = f" AND hash(s.item_id, {int(seed)}) < {int(share * (2**64 - 1))}::UBIGINT"
        rows = cur.sql(f"SELECT {columns}{extra} {joined}{drawn} ORDER BY s.item_id").to_arrow_table()
    if at_most and len(rows) > at_most:
        rows = rows.take(pa.array(np.sort(np.random.default_rng(seed).choice(len(rows), at_most, replace=False))))
    return rows


def live_count_of(state: CatalogueState, wanted: pa.Table | str) -> tuple[int, int]:
    """(the items in `wanted`, how many of them are live): counts in the state's database."""
    from imgest.state.rows import SORT_MEMORY, one_thread

    with state.sql() as cur, one_thread(cur, SORT_MEMORY):
        source = _wanted(cur, wanted)
        return cur.execute(f"SELECT count(*), count(s.item_id) FROM {source} w LEFT JOIN state s "
                       f"ON s.item_id = w.item_id AND s.status = '{LIVE}'").fetchone()


def _wanted(cur, wanted: pa.Table | str) -> str:
    if isinstance(wanted, str):
        return wanted
    cur.register("wanted", wanted)
    return "wanted"


def shard_sample(state: CatalogueState, count: int, seed: int, exclude: pa.Array | None = None) -> pa.Table:
    """About `count` live rows (item_id, uri, content_hash, shard) outside `exclude`, drawn by shard: the shards in
    a seeded order until they hold twice `count` such rows, then `count` rows among theirs, in item_id order.
    What is read is a row per shard and the drawn shards' rows, never the live set; all of it when it is smaller
    than `count`."""
    if count <= 0:
        return pa.table({c: pa.array([], pa.string()) for c in ("item_id", "uri", "content_hash", "shard")})
    rng = np.random.default_rng(seed)
    excluded = pa.table({"item_id": pa.array(exclude if exclude is not None else [], pa.string())})
    with state.sql() as cur:
        cur.register("excluded", excluded)
        per_shard = cur.sql(f"SELECT s.shard, count(*) AS n FROM state s ANTI JOIN excluded e ON e.item_id = s.item_id "
                            f"WHERE s.status = '{LIVE}' GROUP BY s.shard ORDER BY s.shard").to_arrow_table()
        order = rng.permutation(len(per_shard))
        held = np.cumsum(per_shard["n"].to_numpy()[order])
        drawn = order[:int(np.searchsorted(held, 2 * count)) + 1]
        cur.register("drawn", pa.table({"shard": per_shard["shard"].take(pa.array(np.sort(drawn)))}))
        rows = cur.sql(f"SELECT {ROW_COLUMNS} FROM state s SEMI JOIN drawn d ON d.shard = s.shard "
                       f"ANTI JOIN excluded e ON e.item_id = s.item_id WHERE s.status = '{LIVE}' "
                       "ORDER BY s.item_id").to_arrow_table()
    if len(rows) > count:
        rows = rows.take(pa.array(np.sort(rng.choice(len(rows), size=count, replace=False))))
    return rows


def read_rows_vectors(store: Location, slug: str, dim: int, rows: pa.Table,
                      encoded_by: Counter | None = None) -> tuple[pa.Table, np.ndarray]:
    """The vectors of `rows` (item_id, shard, any other columns: `live_rows_of`'s or `shard_sample`'s), read shard by
    shard into their places (on the heap, or memory-mapped past SPILL_BYTES): the rows found in their shards, in
    their order, and their vectors. With `encoded_by`, the rows found are counted under what encoded them."""
    vectors = vector_array(len(rows), dim)
    found = np.zeros(len(rows), bool)
    for shard, keep, positions in live_by_shard(rows.select(["item_id", "shard"])):
        table, at = _live_rows(store, slug, shard, keep)
        if encoded_by is not None:
            encoded_by[shard_encoder(table.schema.metadata)] += len(table)
        vectors[positions[at]] = embedding_matrix(table, dim)
        found[positions[at]] = True
    if found.all():
        return rows, vectors
    logging.getLogger("imgest").warning("model=%s: %d live item(s) have no row in their shard; going on without them",
                                        slug, int((~found).sum()))
    return rows.filter(pa.array(found)), np.ascontiguousarray(vectors[found])
