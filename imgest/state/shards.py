"""The embedding shard format: its Parquet schema and metadata, and how a reader gets its vectors and encoder."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from imgest.encoders import EncoderSpec
from imgest.names import VERSION
from imgest.storage import records

DTYPES = {"float32": (np.float32, pa.float32()), "float16": (np.float16, pa.float16())}  # names.DTYPES


def embedding_matrix(table: pa.Table, dim: int) -> np.ndarray:
    """A shard table's `embedding` column (fixed-size lists of float32 or float16) as a (rows, dim) float32
    array: every reader (index build, export, heads, eval) works in float32 whatever the shards hold."""
    flat = table.column("embedding").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    return flat.reshape(len(table), dim).astype(np.float32, copy=False)


UNRECORDED = "unrecorded"  # what encoded a shard written before the writer recorded it


def shard_encoder(metadata: dict | None) -> str:
    """What encoded every row of a shard, as "runtime precision" ("openvino fp32"), from its Parquet metadata
    (`imgest.runtime`, `imgest.precision`, written by ShardWriter; bytes or str keys); "unrecorded" without them.
    A value that is not a plain name counts as unrecorded: the metadata is read from a store, and the label is
    printed."""
    meta = metadata or {}
    runtime, precision = (meta.get(key, meta.get(key.encode())) for key in ("imgest.runtime", "imgest.precision"))
    names = [v.decode(errors="replace") if isinstance(v, bytes) else v for v in (runtime, precision)]
    if not all(isinstance(v, str) and records.SLUG.match(v) for v in names):
        return UNRECORDED
    return " ".join(names)


def shard_decoder(metadata: dict | None) -> str:
    """The JPEG decoder that made every row of a shard (`imgest.decoder`, written by ShardWriter), a registered
    name only (the metadata is read from a store); "unrecorded" without it (a shard from before, or a text model's)."""
    from imgest.names import DECODERS

    meta = metadata or {}
    name = meta.get("imgest.decoder", meta.get(b"imgest.decoder"))
    name = name.decode(errors="replace") if isinstance(name, bytes) else name
    return name if name in DECODERS else UNRECORDED


def shard_schema(spec: EncoderSpec, dtype: str = "float32") -> pa.Schema:
    fields = [
        ("item_id", pa.string()),
        ("uri", pa.string()),
        ("content_hash", pa.string()),
        ("model_id", pa.string()),
        ("embedding", pa.list_(DTYPES[dtype][1], spec.dim)),
        ("etag", pa.string()),
        ("size", pa.int64()),
        ("mtime", pa.float64()),
        ("run_id", pa.string()),
        ("encoded_at", pa.timestamp("us", tz="UTC")),
    ]
    return pa.schema(fields, metadata=spec_metadata(spec, dtype))


def spec_metadata(spec: EncoderSpec, dtype: str = "float32") -> dict[str, str]:
    import json

    return {
        "imgest.version": VERSION,
        "imgest.model_id": spec.model_id,
        "imgest.model_name": spec.name,
        "imgest.model_revision": spec.revision,
        "imgest.dim": str(spec.dim),
        "imgest.dtype": dtype,  # of the stored vectors; the encoder's output is float32, L2-normalised
        "imgest.normalisation": "l2",
        "imgest.preprocessing": json.dumps(spec.preprocessing, sort_keys=True),
    }
