"""Export of a model's live embeddings as one Parquet file (one row per live item), for bulk import elsewhere;
with the catalogue metadata's columns beside them when the store holds metadata."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from imgest.scratch import scratch_folder
from imgest.state.committed import load_state
from imgest.state.live import iter_live_tables
from imgest.state.metadata import snapshot_file
from imgest.state.models import default_model, find_model
from imgest.storage import Location, open_location


def export_live(store_url: str, model: str | None, out: str) -> dict:
    """One row per live item of ``model`` (None: the store's own, `default_model`), written shard by shard so
    memory holds one shard at a time; the metadata's columns merged on item_id beside them (imgest/state/live.py
    `iter_live_tables`), never loaded whole."""
    store = open_location(store_url, must_exist=True, what="store")
    card = find_model(store, default_model(store, model))
    state = load_state(store, card["slug"])
    target = Location(out)
    rows = 0
    metadata = snapshot_file(store, scratch_folder(state, "export"))
    with target.open_output("") as fh:
        writer = None
        for table in iter_live_tables(store, state, metadata):
            table = as_float32(table, int(card["dim"]))  # float16 shards export as float32, like the others
            if writer is None:
                writer = pq.ParquetWriter(fh, table.schema, compression="zstd")
            writer.write_table(table.cast(writer.schema))
            rows += table.num_rows
        if writer is None:  # an empty export still has the right columns
            writer = pq.ParquetWriter(fh, _empty_schema(card), compression="zstd")
        writer.close()
    return {"model_id": card["model_id"], "slug": card["slug"], "rows": rows, "out": target.url}


def _empty_schema(card: dict) -> pa.Schema:
    return pa.schema([("item_id", pa.string()), ("uri", pa.string()), ("content_hash", pa.string()),
                      ("model_id", pa.string()), ("embedding", pa.list_(pa.float32(), int(card["dim"])))],
                     metadata={"imgest.model_id": card["model_id"], "imgest.dim": str(card["dim"])})


def as_float32(table: pa.Table, dim: int) -> pa.Table:
    """The table with its embedding column as fixed-size lists of float32 (metadata kept, dtype said)."""
    field = pa.field("embedding", pa.list_(pa.float32(), dim))
    if table.schema.field("embedding").type == field.type:
        return table
    i = table.schema.get_field_index("embedding")
    meta = {**(table.schema.metadata or {}), b"imgest.dtype": b"float32", b"imgest.stored_dtype": b"float16"}
    return table.set_column(i, field, table.column(i).cast(field.type)).replace_schema_metadata(meta)
