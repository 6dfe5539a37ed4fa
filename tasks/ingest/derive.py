"""A head model's rows derived from its base model's stored vectors: no image read, no base model run.

An item whose base embedding is current (same content hash as the head's planned row) is looked up in the
base model's shard, within that shard only, and the head applied to its stored vector; the rest go on to be
read and decoded.
"""

from __future__ import annotations

from imgest.encoders import Encoder
from imgest.state.layout import shard_key
from imgest.state.shards import embedding_matrix
from imgest.storage import Location
from imgest.tasks.ingest.plan import WorkItem
from imgest.tasks.ingest.writer import ShardWriter


def derive_from_base(items: tuple[WorkItem, ...], encoder: Encoder, store: Location,
                     writer: ShardWriter) -> tuple[WorkItem, ...]:
    """A head model: items whose base embedding is current get the head applied to it, read from the
    base model's shard (no image decoded); returns the items that still have to be read."""
    base_slug = encoder.spec.base.slug
    by_shard: dict[str, list[WorkItem]] = {}
    rest = []
    for item in items:
        if item.verdict is not None:
            rest.append(item)  # rejected from its listing: prepare() records it
        elif item.base_shard and item.base_hash and item.prev_hash == item.base_hash:
            # same bytes as the head's own row (or its tombstone's, which is revived): nothing to encode
            (writer.revive if item.revive_shard else writer.unchanged)(item, item.base_hash)
        elif item.base_shard:
            by_shard.setdefault(item.base_shard, []).append(item)
        else:
            rest.append(item)
    for base_shard, group in sorted(by_shard.items()):
        table = store.read_table(shard_key(base_slug, base_shard), columns=["item_id", "content_hash", "embedding"])
        rows = {(i, h): n for n, (i, h) in enumerate(zip(table.column("item_id").to_pylist(),
                                                         table.column("content_hash").to_pylist()))}
        found = [(item, rows[(item.item_id, item.base_hash)]) for item in group
                 if (item.item_id, item.base_hash) in rows]
        rest.extend(item for item in group if (item.item_id, item.base_hash) not in rows)  # not there: decode
        if not found:
            continue
        base = embedding_matrix(table, encoder.spec.base.dim)[[n for _, n in found]]
        writer.add([(item, item.base_hash) for item, _ in found], encoder.derive(base))
        writer.result.derived += len(found)
    order = {item.item_id: n for n, item in enumerate(items)}
    return tuple(sorted(rest, key=lambda it: order[it.item_id]))
