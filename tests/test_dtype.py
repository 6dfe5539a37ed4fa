"""float16 shards: half the bytes; the row type and file metadata say so; indexes, export and search read
them (and stores mixing float32 and float16 runs) in float32."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from imgest.config import IndexConfig
from imgest.flows.build_index import build_index
from imgest.retrieval.query import search
from imgest.state.export import export_live
from tests.helpers import gradient, ingest_into, png_bytes, write_files

pytestmark = pytest.mark.usefixtures("prefect_harness")
MODEL = "raw-pixels"


def _shards(store) -> list:
    return sorted((store / "embeddings").glob("model=*/*.parquet"))


def test_float16_shards_are_half_the_vectors_and_read_everywhere(tmp_path):
    cat = tmp_path / "cat"
    write_files(str(cat), {f"p/{i:03d}.png": png_bytes(gradient(i, (40, 40))) for i in range(24)})
    runs = {}
    for dtype in ("float32", "float16"):
        store = tmp_path / dtype
        runs[dtype] = ingest_into(cat, store, model=MODEL, batch_size="8", shard_size=24, dtype=dtype)
        (shard,) = _shards(store)
        table = pq.read_table(shard)
        assert table.schema.field("embedding").type.value_type == (pa.float16() if dtype == "float16" else pa.float32())
        assert table.schema.metadata[b"imgest.dtype"] == dtype.encode()
    half, full = (pq.read_metadata(_shards(tmp_path / d)[0]) for d in ("float16", "float32"))
    vec_bytes = {d: sum(m.row_group(0).column(i).total_uncompressed_size for i in range(m.num_columns)
                        if m.schema.column(i).path.startswith("embedding")) for d, m in (("float16", half),
                                                                                       ("float32", full))}
    assert vec_bytes["float16"] <= 0.55 * vec_bytes["float32"], vec_bytes

    exported = {}
    for dtype in ("float32", "float16"):
        out = tmp_path / f"{dtype}.parquet"
        export_live(str(tmp_path / dtype), MODEL, str(out))
        table = pq.read_table(out)
        assert table.schema.field("embedding").type.value_type == pa.float32()
        order = np.argsort(table.column("item_id").to_pylist())
        exported[dtype] = np.asarray(table.column("embedding").to_pylist(), np.float32)[order]
    np.testing.assert_allclose(exported["float16"], exported["float32"], atol=1e-3)

    store = tmp_path / "float16"
    write_files(str(cat), {f"p/{i:03d}.png": png_bytes(gradient(i, (40, 40))) for i in range(24, 30)})
    ingest_into(cat, store, model=MODEL, batch_size="8", dtype="float32")  # mixed store
    built = build_index(IndexConfig(store=str(store), model=MODEL))
    assert built["card"]["n"] == 30
    query = os.path.join(cat, "p", "027.png")
    assert search(str(store), image=query, k=1)[0].item_id == "p/027.png"
    assert search(str(store), image=os.path.join(cat, "p", "003.png"), k=1)[0].item_id == "p/003.png"
