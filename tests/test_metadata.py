"""Catalogue metadata: read from Parquet, CSV and JSONL, checked line by line, stored as snapshots only
when a row changed, with rows for unknown items and items without a row counted."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from imgest.images.listing import Listing, listing_table
from imgest.state.metadata import MetadataError, load_metadata, read_metadata, store_metadata
from imgest.storage import Location, ObjectInfo

CSV = """item_id,product_id,title,caption,category,price
p/1.jpg,00017,Red canvas sneaker,"A red sneaker, side view",shoes,39.5
p/2.jpg,00017,Red canvas sneaker,top view,shoes,39.5
p/3.jpg,00042,Blue wool coat,,coats,120
"""


def test_csv_is_typed_and_ids_keep_their_zeros(tmp_path):
    (tmp_path / "m.csv").write_text(CSV)
    table = read_metadata(str(tmp_path / "m.csv"))
    assert table.column("item_id").to_pylist() == ["p/1.jpg", "p/2.jpg", "p/3.jpg"]
    assert table.column("product_id").to_pylist() == ["00017", "00017", "00042"]
    assert table.column("caption").to_pylist() == ["A red sneaker, side view", "top view", None]
    assert table.schema.field("price").type == pa.float64() and table.column("price").to_pylist()[2] == 120.0
    assert table.schema.field("category").type == pa.string()
    assert len(set(table.column("row_hash").to_pylist())) == 3


def test_the_three_formats_give_the_same_table(tmp_path):
    (tmp_path / "m.csv").write_text(CSV)
    table = read_metadata(str(tmp_path / "m.csv"))
    rows = table.drop(["row_hash"]).to_pylist()
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pq.write_table(table.drop(["row_hash"]), tmp_path / "m.parquet")
    for other in ("m.jsonl", "m.parquet"):
        assert read_metadata(str(tmp_path / other)).to_pylist() == table.to_pylist(), other


@pytest.mark.parametrize("name, content, message", [
    ("bad.csv", "item_id,title\np/1.jpg,a\np/2.jpg,b,extra\n", r"bad.csv line 3: 3 fields, the header has 2"),
    ("dup.csv", "item_id,title\np/1.jpg,a\np/2.jpg,b\np/1.jpg,c\n", r"dup.csv line 4: item_id 'p/1.jpg' again "
                                                                   r"\(first at line 2\)"),
    ("none.jsonl", '{"item_id": "a"}\n{"title": "no id"}\n', r"none.jsonl line 2: no item_id"),
    ("bad.jsonl", '{"item_id": "a"}\n\n{"item_id": "b",}\n', r"bad.jsonl line 3: not JSON"),
    ("m.xlsx", "x", r"unknown metadata format '.xlsx'"),
    ("q.csv", 'item_id,title\np/1.jpg,"unclosed\n', r"q.csv line \d+: "),
])
def test_a_malformed_file_is_one_error_naming_the_line(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(MetadataError, match=message):
        read_metadata(str(tmp_path / name))


def _listing(*keys: str) -> Listing:
    return Listing(catalogue="c", table=listing_table(ObjectInfo(k, 1, None, None) for k in sorted(keys)))


def test_snapshots_only_when_a_row_changes_and_unknown_rows_are_counted(tmp_path):
    store = Location(str(tmp_path / "store"))
    (tmp_path / "m.csv").write_text(CSV)
    url = str(tmp_path / "m.csv")
    listed = _listing("p/1.jpg", "p/2.jpg", "p/9.jpg")
    first = store_metadata(store, url, listed)
    assert (first.written, first.snapshot_seq, first.new, first.rows) == (True, 1, 3, 3)
    assert (first.unknown_items, first.unknown_examples, first.without_row, first.without_row_examples) == \
        (1, ["p/3.jpg"], 1, ["p/9.jpg"])
    again = store_metadata(store, url, listed)
    assert (again.written, again.snapshot_seq, again.unchanged) == (False, 1, 3)

    (tmp_path / "m.csv").write_text(CSV.replace("top view", "\"top view, laces\"").replace(
        "p/3.jpg,00042,Blue wool coat,,coats,120\n", "") + "p/9.jpg,00099,Green scarf,,scarves,15\n")
    third = store_metadata(store, url, listed)
    assert (third.written, third.snapshot_seq, third.new, third.changed, third.removed, third.unchanged) == \
        (True, 2, 1, 1, 1, 1)
    stored = load_metadata(store)
    assert stored.column("item_id").to_pylist() == ["p/1.jpg", "p/2.jpg", "p/9.jpg"]
    meta = {k.decode(): v.decode() for k, v in stored.schema.metadata.items()}
    assert meta["imgest.rows"] == "3" and json.loads(meta["imgest.report"])["changed"] == 1


def test_a_snapshot_of_an_earlier_hash_scheme_is_compared_by_content(tmp_path):
    """A snapshot written before the row hash moved into DuckDB holds other hashes; the same rows read again
    after an upgrade change nothing and write no snapshot."""
    (tmp_path / "m.csv").write_text(CSV)
    store = Location(str(tmp_path / "store"))
    table = read_metadata(str(tmp_path / "m.csv"))
    earlier = table.set_column(table.schema.get_field_index("row_hash"), "row_hash",
                               pa.array([f"{n:064x}" for n in range(table.num_rows)]))
    store.write_table("metadata/snapshots/00000001.parquet", earlier.replace_schema_metadata({"imgest.rows": "3"}))
    report = store_metadata(store, str(tmp_path / "m.csv"), _listing("p/1.jpg", "p/2.jpg", "p/3.jpg"))
    assert (report.written, report.snapshot_seq, report.unchanged, report.changed) == (False, 1, 3, 0)


def test_a_jsonl_column_of_two_types_names_the_line_across_blocks(tmp_path, monkeypatch):
    from imgest.state import metadata_file

    monkeypatch.setattr(metadata_file, "BLOCK_BYTES", 1_024)  # Arrow types each block alone
    lines = [json.dumps({"item_id": f"p/{n}", "price": n}) for n in range(200)]
    lines[150] = json.dumps({"item_id": "p/150", "price": "n/a"})
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(MetadataError, match=r"m.jsonl line 151: column 'price' holds a string here and a number "
                                            r"before; one type a column"):
        read_metadata(str(tmp_path / "m.jsonl"))


@pytest.mark.parametrize("cells, kind", [(["7", "12", " 3"], pa.int64()), (["7", "12.0", "-1e2"], pa.float64()),
                                         (["7", "12", "seven"], pa.string()), (["007", "12", ""], pa.int64())])
def test_a_csv_column_is_typed_over_every_block(tmp_path, monkeypatch, cells, kind):
    from imgest.state import metadata_file

    monkeypatch.setattr(metadata_file, "BLOCK_BYTES", 256)  # the odd cell is blocks away from the first
    rows = [f"p/{n:04d},{cells[0]}" for n in range(100)] + [f"q/1,{cells[1]}", f"q/2,{cells[2]}"]
    (tmp_path / "m.csv").write_text("item_id,size\n" + "\n".join(rows) + "\n")
    table = read_metadata(str(tmp_path / "m.csv"))
    assert table.schema.field("size").type == kind and table.num_rows == 102


@pytest.mark.slow("an S3 server")
def test_metadata_from_an_s3_url_into_an_s3_store(s3_endpoint):
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})
    fs.mkdir("meta-bucket")
    fs.pipe("meta-bucket/exports/m.csv", CSV.encode())
    store = Location("s3://meta-bucket/store")
    first = store_metadata(store, "s3://meta-bucket/exports/m.csv", _listing("p/1.jpg", "p/2.jpg", "p/3.jpg"))
    assert (first.written, first.new, first.unknown_items, first.without_row) == (True, 3, 0, 0)
    again = store_metadata(store, "s3://meta-bucket/exports/m.csv", _listing("p/1.jpg", "p/2.jpg", "p/3.jpg"))
    assert (again.written, again.unchanged) == (False, 3)
    assert load_metadata(store).column("product_id").to_pylist() == ["00017", "00017", "00042"]


@pytest.mark.parametrize("shuffled", [False, True])
def test_the_snapshot_is_in_item_id_order_whatever_the_file_order(tmp_path, shuffled, monkeypatch):
    """A file sorted by item_id is kept in its order (no sort); any other order is sorted, and its ids are
    checked for duplicates across blocks."""
    from imgest.state import metadata_file

    monkeypatch.setattr(metadata_file, "BLOCK_BYTES", 2_048)
    ids = [f"p/{n:05d}.jpg" for n in range(3_000)]
    if shuffled:
        ids = ids[1_500:] + ids[:1_500]
    (tmp_path / "m.csv").write_text("item_id,title\n" + "".join(f"{i},t {i}\n" for i in ids))
    store = Location(str(tmp_path / "store"))
    report = store_metadata(store, str(tmp_path / "m.csv"), None)
    assert report.written and load_metadata(store).column("item_id").to_pylist() == sorted(ids)
    (tmp_path / "d.csv").write_text("item_id,title\n" + "".join(f"{i},t\n" for i in ids) + f"{ids[5]},again\n")
    with pytest.raises(MetadataError, match=rf"d.csv line 3002: item_id '{ids[5]}' again \(first at line 7\)"):
        read_metadata(str(tmp_path / "d.csv"))


@pytest.mark.slow("a Prefect server")
def test_a_malformed_file_fails_its_task_once_not_after_retries(prefect_harness, tmp_path, monkeypatch):
    """The store-metadata task retries store faults, but the same file fails the same way: one try, one error
    (a 100M-row file read four times is an hour lost before the run says what is wrong)."""
    from prefect import flow

    from imgest.tasks.ingest import steps

    tries = []
    real = steps.store_metadata
    monkeypatch.setattr(steps, "store_metadata", lambda *a: tries.append(1) or real(*a))
    (tmp_path / "bad.csv").write_text("item_id,title\np/1.jpg,a\np/2.jpg,b,extra\n")

    @flow
    def store_it():
        return steps.store_metadata_task(str(tmp_path / "store"), str(tmp_path / "bad.csv"), _listing("p/1.jpg"))

    with pytest.raises(MetadataError, match=r"bad.csv line 3: 3 fields, the header has 2"):
        store_it()
    assert len(tries) == 1
