"""Catalogue metadata holds no Python object per row: the file is read a block at a time by Arrow, and the
checks that need every row (unique item_id, types), the row hash, the diff against the last snapshot and the
join with the listing run in DuckDB on disk. Measured with tracemalloc (Python objects and numpy arrays;
DuckDB's and Arrow's buffers are neither) at 200,000 rows in blocks of 512 KB, against a cap that one Python
string per row could not meet (the item ids alone, as strings, are over 14 MB); the per-row parse it replaces
took ~250 bytes a cell, ~350 MB here."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from imgest.images.listing import LISTING_SCHEMA, Listing, SpillFolder
from imgest.state import metadata_file
from imgest.state.metadata import load_metadata, snapshot_key, store_metadata
from imgest.storage import Location
from tests.helpers import traced

N = 200_000
CAP = 8 << 20  # a block's few arrays and the report: nothing in proportion to N


def catalogue(changed: int = 0) -> pa.Table:
    """N rows as a catalogue's export has them; `changed` rows (every 100th) with a new price and title."""
    n = np.arange(N)
    ids = pa.array([f"products/sku-{i:08d}.jpg" for i in range(N)])
    price = np.round(5 + (n * 7919 % 20000) / 100, 2)
    title = pa.array([f"Canvas sneaker model {i % 977} in {('red', 'blue', 'black')[i % 3]}" for i in range(N)])
    if changed:
        hit = (n % 100 == 0) & (n // 100 < changed)
        price = np.where(hit, price + 1, price)
        title = pa.array([t + " (new)" if h else t for t, h in zip(title.to_pylist(), hit)])
    return pa.table({"item_id": ids, "product_id": pa.array([f"{i // 4:07d}" for i in range(N)]), "title": title,
                     "category": pa.array(["shoes", "coats", "bags", "scarves"] * (N // 4)), "price": price,
                     "colour": pa.array(["red", "blue", "black", "green", "white"] * (N // 5)),
                     "description": pa.array([f"A product description of item {i}, " * 4 for i in range(N)])})


def spilled_listing(keys: pa.Array) -> Listing:
    """The listing as a nightly has it at scale: Parquet files on local disk, never a table in memory."""
    folder = SpillFolder()
    table = pa.table({"key": keys, "key_ok": pa.array([True] * len(keys)), "size": pa.array([1] * len(keys)),
                      "mtime": pa.nulls(len(keys), pa.float64()), "etag": pa.nulls(len(keys), pa.string()),
                      "storage_class": pa.nulls(len(keys), pa.string())}, schema=LISTING_SCHEMA)
    return Listing("s3://shop", files=[folder.write("part.parquet", table.to_batches(50_000))], spill=[folder])


@pytest.mark.slow("200,000 rows, in three formats, two nights each")
@pytest.mark.parametrize("fmt", ["csv", "parquet", "jsonl"])
def test_a_large_file_streams_and_a_one_percent_night_writes_one_snapshot(tmp_path, monkeypatch, fmt):
    monkeypatch.setattr(metadata_file, "BLOCK_BYTES", 512 << 10)
    monkeypatch.setattr(metadata_file, "PARQUET_BATCH_ROWS", 4_096)
    store = Location(str(tmp_path / "store"))
    first, second = tmp_path / f"first.{fmt}", tmp_path / f"second.{fmt}"
    for path, table in ((first, catalogue()), (second, catalogue(changed=N // 100))):
        if fmt == "csv":
            pcsv.write_csv(table, path)
        elif fmt == "parquet":
            pq.write_table(table, path, row_group_size=50_000)
        else:
            with open(path, "w") as fh:
                for batch in table.to_batches(20_000):
                    fh.writelines(json.dumps(row) + "\n" for row in batch.to_pylist())
    keys = catalogue().column("item_id").combine_chunks()
    listing = spilled_listing(pa.concat_arrays([keys.slice(10), pa.array(["products/unlisted-1.jpg"])]))

    night, peak = traced(lambda: store_metadata(store, str(first), listing))
    assert (night.written, night.rows, night.new, night.snapshot_seq) == (True, N, N, 1)
    assert (night.unknown_items, night.without_row, night.without_row_examples) == \
        (10, 1, ["products/unlisted-1.jpg"])
    assert night.unknown_examples == [f"products/sku-{i:08d}.jpg" for i in range(10)]
    assert peak < CAP, f"{fmt}: {peak / 1e6:.1f} MB of Python objects and arrays for {N} rows"

    again, peak = traced(lambda: store_metadata(store, str(second), listing))
    assert (again.written, again.snapshot_seq, again.changed, again.unchanged, again.new, again.removed) == \
        (True, 2, N // 100, N - N // 100, 0, 0)
    assert peak < CAP, f"{fmt}: {peak / 1e6:.1f} MB on the second night"
    assert sorted(p.name for p in (tmp_path / "store" / "metadata" / "snapshots").iterdir()) == \
        [snapshot_key(1).split("/")[-1], snapshot_key(2).split("/")[-1]]
    stored = load_metadata(store)
    assert stored.num_rows == N and stored.column("item_id").to_pylist() == sorted(keys.to_pylist())
    assert stored.schema.field("price").type == pa.float64() and stored.schema.field("product_id").type == pa.string()
    assert stored.column("title")[0].as_py().endswith("(new)")

    unchanged = store_metadata(store, str(second), listing)
    assert (unchanged.written, unchanged.snapshot_seq, unchanged.unchanged) == (False, 2, N)
