"""The caption retriever's side of ingest: metadata rows as the objects a text model encodes.

A text model's "catalogue" is the text of the stored metadata snapshot, one item per listed image with a
non-empty text (its columns joined as the model's preprocessing says). An item's signature is the hash of
that text, so planning, shards, state, tombstones and the mass-delete guard work as for images: a row is
encoded again only when its text changes, and the item's URI stays the image's, so a hit can be shown.
"""

from __future__ import annotations

import hashlib
import os
import socket

import pyarrow as pa
import pyarrow.compute as pc

from imgest.encoders import Encoder, EncoderSpec
from imgest.encoders.text import compose
from imgest.images.listing import Listing, listing_table
from imgest.lock import Fence
from imgest.names import DEFAULT_DTYPE
from imgest.storage import Location, ObjectInfo
from imgest.tasks.ingest.plan import ShardPlan, WorkItem
from imgest.tasks.ingest.writer import ShardResult, ShardWriter
from imgest.timing import Stopwatch


def text_of(table: pa.Table, spec: EncoderSpec, items: set[str] | None = None) -> dict[str, str]:
    """item_id -> the text the model reads, for rows that have any (of `items` only, when given)."""
    fields = spec.preprocessing["text_fields"]
    present = [f for f in fields if f in table.column_names]
    table = table.select(["item_id", *present])
    if items is not None:  # one shard's rows: compose those, not the whole catalogue's
        table = table.filter(pc.is_in(table["item_id"], value_set=pa.array(sorted(items), pa.string())))
    rows = table.to_pylist()
    texts = {r["item_id"]: compose(r, present, spec.preprocessing["joiner"]) for r in rows}
    return {item: text for item, text in texts.items() if text}


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def text_listing(images: Listing, table: pa.Table, spec: EncoderSpec) -> tuple[Listing, dict]:
    """The listing a text model plans from: listed images that have text; and what was left out."""
    texts = text_of(table, spec)
    listed = set(images.keys)
    objects = [ObjectInfo(key=item, size=len(text.encode("utf-8")), mtime=None, etag=text_hash(text))
               for item, text in sorted(texts.items()) if item in listed]
    left_out = {"rows_without_text": table.num_rows - len(texts),
                "rows_for_unlisted_items": sum(1 for item in texts if item not in listed),
                "images_without_text": len(listed) - len(objects)}
    return Listing(catalogue=images.catalogue, table=listing_table(objects)), left_out


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
