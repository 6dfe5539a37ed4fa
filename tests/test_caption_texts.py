"""The caption retriever's texts as columns: the listing's text and hash equal `compose` and `text_hash` row for
row (nulls, empty and blank fields, every kind of white space, any character), the listing spills like the image
listing, and a shard reads only the snapshot's row groups that can hold its items."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from imgest import encoders
from imgest.encoders.text import compose, whitespace
from imgest.images.listing import LISTING_SCHEMA, Listing, SpillFolder, listing_batches, listing_table
from imgest.state.metadata import snapshot_key, store_metadata
from imgest.storage import Location, ObjectInfo
from imgest.tasks.ingest.encode_text import shard_texts, text_hash, text_listing


@pytest.fixture(scope="module")
def spec():
    return encoders.resolve("minilm-l6")


TRICKY = [
    {"item_id": "a", "title": " Red sneaker ", "caption": None, "description": "canvas"},
    {"item_id": "b", "title": "", "caption": "  ", "description": None},  # blank: no text
    {"item_id": "c", "title": None},  # nothing at all
    {"item_id": "d", "title": "\u00a0\u2003café\u3000", "caption": "\t\n", "description": "naïve 🧥 coat\u2028"},
    {"item_id": "e", "title": "it's \"quoted\"", "caption": "a. b", "description": "x\u0085"},
    {"item_id": "f", "title": "\u200b", "caption": "\x1c\x1d\x1e\x1f", "description": "e\u0301 \U0001f600"},
    {"item_id": "g", "caption": "caption only"},
    {"item_id": "h", "title": "multi\nline\r\ntitle", "description": "  \u180e  "},  # U+180E is not space
    {"item_id": "ü/ß.jpg", "title": "🧥", "description": ". "},
]


def test_whitespace_is_what_str_strip_removes():
    assert whitespace() == "".join(c for c in map(chr, range(0x110000)) if c.isspace())
    assert {"\u00a0", "\u3000", "\x85", "\u2028", " "} <= set(whitespace()) and "\u200b" not in whitespace()


def test_text_listing_and_shard_texts_compose_as_compose_does(spec, tmp_path):
    """Tricky rows read and stored by the real metadata path: the listing's size and etag are the UTF-8 length
    and the sha256 of `compose`'s text, the shard's texts are `compose`'s; rows without text are left out."""
    fields, joiner = spec.preprocessing["text_fields"], spec.preprocessing["joiner"]
    path = tmp_path / "meta.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TRICKY))
    store = Location(str(tmp_path / "store"))
    assert store_metadata(store, str(path)).written
    expected = {r["item_id"]: compose(r, fields, joiner) for r in TRICKY}
    expected = {item: text for item, text in expected.items() if text}
    assert set(expected) == {"a", "d", "e", "f", "g", "h", "ü/ß.jpg"}  # the case: b and c have no text
    assert expected["d"] == "café. naïve 🧥 coat" and expected["ü/ß.jpg"] == "🧥. ."

    images = Listing(catalogue=str(tmp_path), table=listing_table(
        [ObjectInfo(r["item_id"], 1, 1.0, None) for r in TRICKY if r["item_id"] != "e"] + [
            ObjectInfo("z-no-row", 1, 1.0, None)]))
    with store.parquet_file(snapshot_key(1)) as snapshot:
        listing, left_out = text_listing(images, snapshot, spec)
        got = shard_texts(snapshot, spec, [r["item_id"] for r in TRICKY]).texts
    assert got == expected
    rows = listing.read().to_pylist()
    assert [r["key"] for r in rows] == sorted(set(expected) - {"e"})
    assert {r["key"]: (r["size"], r["etag"]) for r in rows} == {
        item: (len(text.encode("utf-8")), text_hash(text)) for item, text in expected.items() if item != "e"}
    assert all(r["key_ok"] and r["mtime"] is None for r in rows)
    # 9 rows, 2 without text; e has text but no image; b, c and z-no-row are images without text
    assert left_out == {"rows_without_text": 2, "rows_for_unlisted_items": 1, "images_without_text": 3}


def test_every_character_composes_as_python_strips_it(spec):
    """Each character of the Basic Multilingual Plane and every white space beyond it, on both sides of a title
    and alone as a caption: DuckDB's text and hash equal Python's."""
    chars = [chr(c) for c in range(0x10000) if not 0xD800 <= c < 0xE000] + ["\U0001f600", "\U000e0020"]
    table = pa.table({"item_id": [f"{n:06d}" for n in range(len(chars))],
                      "title": [f"{c}x{c}" for c in chars], "caption": chars})
    fields, joiner = spec.preprocessing["text_fields"], spec.preprocessing["joiner"]
    expected = {r["item_id"]: compose(r, fields, joiner) for r in table.to_pylist()}
    texts = shard_texts(table, spec, expected).texts
    assert texts == expected
    images = Listing(catalogue="/cat", table=table.select(["item_id"]).rename_columns(["key"]))
    listing, _ = text_listing(images, table, spec)
    etags = dict(zip(listing.table["key"].to_pylist(), listing.table["etag"].to_pylist()))
    assert etags == {item: text_hash(text) for item, text in expected.items()}


def _snapshot(store: Location, rows: int, group_rows: int) -> pa.Table:
    """A sorted snapshot of `rows` items written with row groups of `group_rows`."""
    ids = [f"p/{n:07d}.jpg" for n in range(rows)]
    table = pa.table({"item_id": ids, "product_id": [f"P{n // 3}" for n in range(rows)],
                      "title": [f"title of item {n}" for n in range(rows)],
                      "caption": pa.nulls(rows, pa.string()),
                      "description": [None if n % 7 == 0 else f"a longer description of item {n} " * 3
                                      for n in range(rows)],
                      "row_hash": [str(n) for n in range(rows)]})
    os.makedirs(os.path.dirname(store.path(snapshot_key(1))), exist_ok=True)
    pq.write_table(table, store.path(snapshot_key(1)), row_group_size=group_rows)
    return table


def test_a_shard_reads_only_the_row_groups_that_hold_its_items(spec, tmp_path):
    """200,000 rows in row groups of 10,000: a shard of 2,000 items of rows 100,000-119,999 reads those two groups,
    a tenth of the snapshot; items at both ends read the first and last group; ids the snapshot lacks read at
    most the group their range falls in, and have no text."""
    store = Location(str(tmp_path / "store"))
    table = _snapshot(store, 200_000, 10_000)
    ids = table["item_id"].to_pylist()
    fields, joiner = spec.preprocessing["text_fields"], spec.preprocessing["joiner"]

    def composed(n: int) -> str:
        return compose({"title": f"title of item {n}", "description": table["description"][n].as_py()}, fields,
                       joiner)

    with store.parquet_file(snapshot_key(1)) as snapshot:
        assert snapshot.metadata.num_row_groups == 20
        shard = shard_texts(snapshot, spec, ids[100_000:120_000:10])
        assert (shard.groups_read, shard.rows_read) == (2, 20_000)
        assert shard.texts == {ids[n]: composed(n) for n in range(100_000, 120_000, 10)}
        ends = shard_texts(snapshot, spec, [ids[0], ids[-1]])
        assert (ends.groups_read, ends.rows_read) == (2, 20_000) and set(ends.texts) == {ids[0], ids[-1]}
        gone = shard_texts(snapshot, spec, ["p/0150000.jpg-gone", "q/after-every-item.jpg", "a/before.jpg"])
        assert gone.groups_read <= 1 and gone.texts == {}


def test_a_spilled_image_listing_gives_a_spilled_text_listing_and_a_changed_row_only_changes_its_etag(spec, tmp_path):
    """The image listing as Parquet files (as a catalogue's is): the text listing comes back as a Parquet file in
    key order; after 1% of the titles change, exactly those rows' etags differ."""
    store = Location(str(tmp_path / "store"))
    table = _snapshot(store, 50_000, 8_192)
    folder = SpillFolder()
    keys = table["item_id"].to_pylist()[::-1][:40_000]  # 10,000 items have metadata and no image
    part = folder.write("listing.parquet", listing_batches(ObjectInfo(k, 1, 1.0, None) for k in keys))
    images = Listing(catalogue=str(tmp_path), files=[part], spill=[folder])
    with store.parquet_file(snapshot_key(1)) as snapshot:
        before, left_out = text_listing(images, snapshot, spec)
    assert before.table is None and len(before.files) == 1 and pq.read_schema(before.files[0]) == LISTING_SCHEMA
    rows = pq.read_table(before.files[0])
    assert rows["key"].to_pylist() == sorted(keys) and len(before) == 40_000
    assert left_out == {"rows_without_text": 0, "rows_for_unlisted_items": 10_000, "images_without_text": 0}

    changed = set(range(0, 50_000, 100))
    titles = [f"new title {n}" if n in changed else t for n, t in enumerate(table["title"].to_pylist())]
    pq.write_table(table.set_column(2, "title", pa.array(titles)), store.path(snapshot_key(1)), row_group_size=8_192)
    with store.parquet_file(snapshot_key(1)) as snapshot:
        after, _ = text_listing(images, snapshot, spec)
    old = dict(zip(rows["key"].to_pylist(), rows["etag"].to_pylist()))
    new = pq.read_table(after.files[0])
    differ = {k for k, e in zip(new["key"].to_pylist(), new["etag"].to_pylist()) if old[k] != e}
    assert differ == {f"p/{n:07d}.jpg" for n in changed} & set(old) and len(differ) == 400


def test_an_object_store_snapshot_is_streamed_and_read_by_row_group(spec, tmp_path, s3_endpoint):
    """A snapshot in an S3 bucket: the listing streams it through ranged reads and a shard reads its items' row
    group; both give what the same snapshot on a local disk gives."""
    import s3fs

    local = Location(str(tmp_path / "store"))
    table = _snapshot(local, 30_000, 4_096)
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})
    fs.mkdir("captions-store")
    remote = Location("s3://captions-store/imgest")
    remote.put_file(snapshot_key(1), local.path(snapshot_key(1)))
    images = Listing(catalogue=str(tmp_path), table=table.select(["item_id"]).rename_columns(["key"])
                     .append_column("key_ok", pa.array([True] * table.num_rows))
                     .append_column("size", pa.array([1] * table.num_rows, pa.int64()))
                     .append_column("mtime", pa.nulls(table.num_rows, pa.float64()))
                     .append_column("etag", pa.nulls(table.num_rows, pa.string()))
                     .append_column("storage_class", pa.nulls(table.num_rows, pa.string())).cast(LISTING_SCHEMA))
    items = table["item_id"].to_pylist()[20_480:20_480 + 4_096:7]
    found = {}
    for store in (local, remote):
        with store.parquet_file(snapshot_key(1)) as snapshot:
            listing, left_out = text_listing(images, snapshot, spec)
            shard = shard_texts(snapshot, spec, items)
        found[store.url] = (listing.read(), left_out, shard)
    (a, a_left, a_shard), (b, b_left, b_shard) = found.values()
    assert a.equals(b) and a.num_rows == 30_000 and a_left == b_left
    assert b_shard.texts == a_shard.texts and len(b_shard.texts) == len(items)
    assert (b_shard.groups_read, b_shard.rows_read) == (1, 4_096)


@pytest.mark.parametrize("prefix", ["p/", "p/" + "x" * 300])
def test_a_snapshot_written_by_duckdb_is_read_by_row_group_and_truncated_statistics_only_widen_it(spec, tmp_path,
                                                                                                   prefix):
    """A snapshot written by DuckDB (row groups of 122,880 rows): a shard's items in the last group read that group
    alone; with item ids past 256 bytes DuckDB writes truncated statistics (every group's range then covers the
    ids), so the shard reads more groups but finds the same texts."""
    import duckdb

    store = Location(str(tmp_path / "store"))
    path = store.path(snapshot_key(1))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with duckdb.connect() as con:
        con.execute(f"""COPY (SELECT '{prefix}' || lpad(i::VARCHAR, 7, '0') AS item_id, 'title ' || i AS title,
                                     CASE WHEN i % 5 = 0 THEN NULL ELSE ' described ' || i END AS description
                              FROM range(250000) t(i) ORDER BY item_id)
                        TO '{path}' (FORMAT parquet, ROW_GROUP_SIZE 122880)""")
    items = [f"{prefix}{n:07d}" for n in range(245_760, 250_000, 3)]
    fields, joiner = spec.preprocessing["text_fields"], spec.preprocessing["joiner"]
    with store.parquet_file(snapshot_key(1)) as snapshot:
        assert snapshot.metadata.num_row_groups == 3
        shard = shard_texts(snapshot, spec, items)
    int_of = {item: int(item[-7:]) for item in items}
    assert shard.texts == {item: compose({"title": f"title {n}", "description": None if n % 5 == 0 else
                                          f" described {n}"}, fields, joiner) for item, n in int_of.items()}
    assert shard.groups_read == (1 if len(prefix) < 256 else 3)
