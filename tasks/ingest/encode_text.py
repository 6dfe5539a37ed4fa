"""The caption retriever's side of ingest: metadata rows as the objects a text model encodes.

A text model's "catalogue" is the text of the stored metadata snapshot, one item per listed image with a
non-empty text (its columns joined as the model's preprocessing says). An item's signature is the hash of
that text, so planning, shards, state, tombstones and the mass-delete guard work as for images: a row is
encoded again only when its text changes, and the item's URI stays the image's, so a hit can be shown.

Both reads of the snapshot are columnar: the listing streams it through DuckDB (texts composed, hashed and
joined with the image listing there, never a Python object per row), and a shard reads only the row groups
whose item_id range holds one of its items (the snapshot is sorted by item_id).
"""

from __future__ import annotations

import bisect
import hashlib
import os
import socket
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from imgest.encoders import Encoder, EncoderSpec
from imgest.encoders.text import joined_sql, stripped
from imgest.images.listing import LISTING_SCHEMA, Listing, SpillFolder
from imgest.names import DEFAULT_DTYPE
from imgest.state.lock import Fence
from imgest.state.rows import ALLOCATOR_FLUSH, STATE_MEMORY
from imgest.storage import Location
from imgest.tasks.ingest.plan import ShardPlan, WorkItem
from imgest.tasks.ingest.writer import ShardResult, ShardWriter
from imgest.timing import Stopwatch

Snapshot = pa.Table | pq.ParquetFile  # a metadata snapshot in memory (small ones, tests), or opened to read in parts
SNAPSHOT_BATCH = 65_536  # snapshot rows DuckDB is handed at a time while the listing streams it


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _columns(snapshot: Snapshot, spec: EncoderSpec) -> list[str]:
    """item_id and the model's text fields the snapshot has, in the model's order."""
    names = snapshot.column_names if isinstance(snapshot, pa.Table) else snapshot.schema_arrow.names
    return ["item_id", *[f for f in spec.preprocessing["text_fields"] if f in names]]


def _stripped(part: pa.Table | pa.RecordBatch, columns: list[str]) -> pa.Table | pa.RecordBatch:
    """item_id and each text field stripped as `compose` strips it (the first half of the text, in Arrow)."""
    arrays = [part["item_id"], *(stripped(part[name]) for name in columns[1:])]
    return (pa.RecordBatch if isinstance(part, pa.RecordBatch) else pa.Table).from_arrays(arrays, names=columns)


def _texts_sql(relation: str, spec: EncoderSpec, columns: list[str]) -> str:
    """item_id and its text over a relation of `_stripped` rows (the second half, in DuckDB)."""
    return f"SELECT item_id, {joined_sql(columns[1:], spec.preprocessing['joiner'])} AS text FROM {relation}"


def _quoted(path: str) -> str:
    return path.replace("'", "''")


def text_listing(images: Listing, snapshot: Snapshot, spec: EncoderSpec) -> tuple[Listing, dict]:
    """The listing a text model plans from: listed images that have text, with the text's length in bytes and
    its hash as their signature; and what was left out. One pass over the snapshot, streamed into DuckDB, which
    composes, hashes and joins with the image listing; the result is spilled to Parquet like the image listing
    when that is (a catalogue's), else held as a table."""
    import duckdb

    columns = _columns(snapshot, spec)
    listing = Listing(catalogue=images.catalogue)
    with tempfile.TemporaryDirectory(prefix="imgest-texts-") as folder:
        config = {"memory_limit": STATE_MEMORY, "preserve_insertion_order": False,
                  "temp_directory": os.path.join(folder, "spill"), "allocator_flush_threshold": ALLOCATOR_FLUSH}
        with duckdb.connect(config=config) as con:
            if isinstance(snapshot, pa.Table):
                con.register("snapshot", _stripped(snapshot, columns))
            else:
                schema = pa.schema([snapshot.schema_arrow.field("item_id"), *((c, pa.string()) for c in columns[1:])])
                # a row group at a time: one read over the whole file keeps every byte it pre-buffered until it ends
                # (the whole compressed snapshot by the last group)
                batches = (batch for group in range(snapshot.metadata.num_row_groups) for batch in
                           snapshot.iter_batches(batch_size=SNAPSHOT_BATCH, columns=columns, row_groups=[group]))
                con.register("snapshot", pa.RecordBatchReader.from_batches(
                    schema, (_stripped(batch, columns) for batch in batches)))
            if isinstance(images.source, list) and images.source:
                con.read_parquet(images.source).create_view("images")
            else:  # a listing held in memory, or one that listed nothing
                con.register("images", images.source or LISTING_SCHEMA.empty_table())
            texts = os.path.join(folder, "texts.parquet")  # item_id, size, etag (null: the row has no text)
            con.execute(f"""COPY (SELECT item_id, strlen(text) AS size, CASE WHEN text <> '' THEN sha256(text) END
                                  AS etag FROM ({_texts_sql('snapshot', spec, columns)}))
                            TO '{_quoted(texts)}' (FORMAT parquet)""")
            texts = f"read_parquet('{_quoted(texts)}')"
            rows, with_text, listed, both = con.execute(f"""
                SELECT count(t.item_id), count(t.etag), count(i.key),
                       count(*) FILTER (t.etag IS NOT NULL AND i.key IS NOT NULL)
                FROM {texts} t FULL JOIN images i ON i.key = t.item_id""").fetchall()[0]
            kept = f"""SELECT t.item_id AS key, TRUE AS key_ok, t.size, CAST(NULL AS DOUBLE) AS mtime, t.etag,
                              CAST(NULL AS VARCHAR) AS storage_class
                       FROM {texts} t SEMI JOIN images i ON i.key = t.item_id
                       WHERE t.etag IS NOT NULL ORDER BY t.item_id"""
            if images.table is None:  # a catalogue's listing: the text listing goes to disk as it did
                listing.spill = [SpillFolder()]
                batches = con.sql(kept).to_arrow_reader(SNAPSHOT_BATCH)
                listing.files = [listing.spill[0].write("texts.parquet", (b.cast(LISTING_SCHEMA) for b in batches))]
            else:
                listing.table = con.sql(kept).to_arrow_table().cast(LISTING_SCHEMA)
    left_out = {"rows_without_text": rows - with_text, "rows_for_unlisted_items": with_text - both,
                "images_without_text": listed - both}
    return listing, left_out


@dataclass
class ShardTexts:
    texts: dict[str, str]  # item_id -> the text the model reads, for the shard's items that have one
    rows_read: int  # snapshot rows read to find them
    groups_read: int  # of the snapshot's row groups


def row_groups_holding(meta: pq.FileMetaData, items: list[str]) -> list[int]:
    """The row groups whose item_id range (from their statistics) holds one of `items` (sorted); a group
    without statistics is read."""
    names = [meta.schema.column(i).path for i in range(meta.num_columns)]
    column = names.index("item_id")
    groups = []
    for group in range(meta.num_row_groups):
        stats = meta.row_group(group).column(column).statistics
        try:  # a writer may truncate long values' statistics (never narrowing the range) or leave them out
            low, high = (stats.min, stats.max) if stats is not None and stats.has_min_max else (None, None)
        except UnicodeDecodeError:  # cut inside a character
            low = high = None
        if low is None or high is None:
            groups.append(group)
            continue
        at = bisect.bisect_left(items, low)
        if at < len(items) and items[at] <= high:
            groups.append(group)
    return groups


def shard_texts(snapshot: Snapshot, spec: EncoderSpec, items: Iterable[str]) -> ShardTexts:
    """The texts of one shard's items, composed as the listing composed them: from the row groups that can hold
    them only, a group at a time, so a shard never reads the snapshot's other rows."""
    import duckdb

    wanted = sorted(set(items))
    columns = _columns(snapshot, spec)
    if isinstance(snapshot, pa.Table):
        groups, parts = [0], iter([snapshot.select(columns)])
    else:
        groups = row_groups_holding(snapshot.metadata, wanted)
        parts = (snapshot.read_row_group(g, columns=columns) for g in groups)
    texts, rows, values = {}, 0, pa.array(wanted, pa.string())
    with duckdb.connect(config={"enable_external_access": False}) as con:
        for part in parts:
            rows += part.num_rows
            # the shard's rows first (a hash lookup), then their text: composing a whole group costs 100x more
            con.register("part", _stripped(part.filter(pc.is_in(part["item_id"], value_set=values)), columns))
            texts.update(con.execute(f"SELECT item_id, text FROM ({_texts_sql('part', spec, columns)}) "
                                     "WHERE text <> ''").fetchall())
            con.unregister("part")
    return ShardTexts(texts, rows, len(groups))


def encode_text_shard(plan: ShardPlan, encoder: Encoder, texts: dict[str, str], store: Location, batch_size: int,
                      fence: Fence | None = None, dtype: str = DEFAULT_DTYPE) -> ShardResult:
    """Encode one shard of texts in batches and commit it (the same writer, marker and result as images)."""
    from datetime import UTC, datetime

    total, encoding = Stopwatch(), Stopwatch(running=False)
    writer = ShardWriter(store, encoder.spec, plan, fence, dtype, encoder.runtime, encoder.precision)
    writer.result.worker = f"{socket.gethostname()}:{os.getpid()}"
    writer.result.started = datetime.now(UTC).isoformat(timespec="microseconds")
    batch: list[tuple[WorkItem, str, str]] = []

    def flush_batch() -> None:
        with encoding:
            vectors = encoder.encode_texts([text for _, _, text in batch])
        writer.add([(item, digest) for item, digest, _ in batch], vectors)
        batch.clear()

    for item in plan.items:
        text = texts.get(item.item_id)
        if text is None:  # its row lost its text, or the row went, after the plan was made
            writer.vanished(item)
            continue
        digest = text_hash(text)
        if item.prev_hash == digest:
            (writer.revive if item.revive_shard else writer.unchanged)(item, digest)
            continue
        batch.append((item, digest, text))
        if len(batch) >= batch_size:
            flush_batch()
    if batch:
        flush_batch()
    result = writer.flush()
    result.seconds, result.encode_seconds = total.seconds, encoding.seconds
    return result
