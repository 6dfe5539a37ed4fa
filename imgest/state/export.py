"""Export of a model's live embeddings as one Parquet file (one row per live item), for bulk import elsewhere;
with the catalogue metadata's columns beside them when the store holds metadata."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from imgest.state.committed import load_state
from imgest.state.live import iter_live_tables
from imgest.state.metadata import load_metadata
from imgest.state.models import default_model, find_model
from imgest.storage import Location, open_location


def export_live(store_url: str, model: str | None, out: str) -> dict:
    """One row per live item of ``model`` (None: the store's own, `default_model`), written shard by shard so
    memory holds one shard at a time."""
    store = open_location(store_url, must_exist=True, what="store")
    card = find_model(store, default_model(store, model))
    state = load_state(store, card["slug"])
    target = Location(out)
    rows = 0
    metadata = load_metadata(store)
    with target.open_output("") as fh:
        writer = None
        for table in iter_live_tables(store, state):
            table = as_float32(table, int(card["dim"]))  # float16 shards export as float32, like the others
            if metadata is not None:
                table = with_metadata(table, metadata)
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


def with_metadata(table: pa.Table, metadata: pa.Table) -> pa.Table:
    """The metadata's columns appended to each row (null where an item has no row); a column whose name the
    embeddings already use is prefixed `metadata_`."""
    rows = metadata.take(pc.index_in(table["item_id"], value_set=metadata["item_id"]))
    for name in metadata.column_names:
        if name in ("item_id", "row_hash"):
            continue
        table = table.append_column(f"metadata_{name}" if name in table.column_names else name, rows[name])
    return table
