"""An S3 Inventory report lists the catalogue as LIST does: a run planned from it and a LIST run agree, object
for object; a report that does not match its manifest, or lists another bucket, lists nothing."""

import csv
import gzip
import hashlib
import io
import json
import uuid
from datetime import datetime
from urllib.parse import quote_plus

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from imgest.config import IngestConfig
from imgest.flows.ingest import ingest
from imgest.images.listing import list_catalogue
from imgest.tasks.ingest.inventory import InventoryError, read_inventory
from tests.helpers import gradient, png_bytes

SCHEMA = ["Bucket", "Key", "VersionId", "IsLatest", "IsDeleteMarker", "Size", "LastModifiedDate", "ETag",
          "StorageClass"]


@pytest.fixture()
def bucket(s3_each_endpoint):
    """A bucket on each S3 server: how a listing spells keys, sizes and ETags is where servers differ."""
    import s3fs

    s3_endpoint = s3_each_endpoint

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})
    name = f"shop-{uuid.uuid4().hex[:8]}"
    fs.mkdir(name)
    fs.mkdir(f"{name}-inventory")
    for i in range(12):
        fs.pipe(f"{name}/products/p{i:02d}.png", png_bytes(gradient(i, (16, 16))))
    fs.pipe(f"{name}/products/with space+plus.png", png_bytes(gradient(50, (16, 16))))
    fs.pipe(f"{name}/products/shoes/.png", png_bytes(gradient(51, (16, 16))))  # a name that is only the suffix
    fs.pipe(f"{name}/products/notes.txt", b"not an image")
    fs.pipe(f"{name}/elsewhere/x.png", png_bytes(gradient(60, (16, 16))))
    return fs, name


def inventory_rows(fs, name: str) -> list[dict]:
    """What S3 would report for the bucket: every current object, plus an old version and a delete marker."""
    rows = []
    for path, info in sorted(fs.find(name, detail=True).items()):
        rows.append({"Bucket": name, "Key": path[len(name) + 1:], "VersionId": "v2", "IsLatest": "true",
                     "IsDeleteMarker": "false", "Size": str(info["size"]),
                     "LastModifiedDate": info["LastModified"].strftime("%Y-%m-%dT%H:%M:%S.000Z"),
                     "ETag": info["ETag"].strip('"'), "StorageClass": "STANDARD"})
    rows.append({**rows[0], "VersionId": "v1", "IsLatest": "false", "ETag": "0ld", "Size": "3"})
    rows.append({**rows[0], "Key": "products/deleted.png", "IsDeleteMarker": "true", "Size": "", "ETag": ""})
    return rows


def write_report(fs, name: str, rows: list[dict], fmt: str) -> str:
    if fmt == "CSV":
        text = io.StringIO()
        writer = csv.writer(text, quoting=csv.QUOTE_ALL)
        for row in rows:
            writer.writerow([quote_plus(row[c], safe="/") if c == "Key" else row[c] for c in SCHEMA])
        data, key = gzip.compress(text.getvalue().encode()), "inv/shop/daily/data/a1.csv.gz"
    else:
        table = pa.table({
            "bucket": [r["Bucket"] for r in rows], "key": [r["Key"] for r in rows],
            "version_id": [r["VersionId"] for r in rows], "is_latest": [r["IsLatest"] == "true" for r in rows],
            "is_delete_marker": [r["IsDeleteMarker"] == "true" for r in rows],
            "size": pa.array([int(r["Size"]) if r["Size"] else None for r in rows], pa.int64()),
            "last_modified_date": pa.array([datetime.strptime(r["LastModifiedDate"], "%Y-%m-%dT%H:%M:%S.000Z")
                                            for r in rows], pa.timestamp("ms")),  # UTC, as S3 writes it
            "e_tag": [r["ETag"] for r in rows], "storage_class": [r["StorageClass"] for r in rows]})
        sink = io.BytesIO()
        pq.write_table(table, sink)
        data, key = sink.getvalue(), "inv/shop/daily/data/a1.parquet"
    fs.pipe(f"{name}-inventory/{key}", data)
    manifest = {"sourceBucket": name, "destinationBucket": f"arn:aws:s3:::{name}-inventory", "version": "2016-11-30",
                "fileFormat": fmt, "fileSchema": ", ".join(SCHEMA),
                "files": [{"key": key, "size": len(data), "MD5checksum": hashlib.md5(data).hexdigest()}]}
    fs.pipe(f"{name}-inventory/inv/shop/daily/2026-11-30T01-00Z/manifest.json", json.dumps(manifest).encode())
    return f"s3://{name}-inventory/inv/shop/daily/2026-11-30T01-00Z/manifest.json"


@pytest.mark.parametrize("fmt", ["CSV", "Parquet"])
def test_an_inventory_lists_what_list_lists(bucket, fmt):
    fs, name = bucket
    manifest = write_report(fs, name, inventory_rows(fs, name), fmt)
    listed = list_catalogue(f"s3://{name}/products")
    from_report = read_inventory(manifest, f"s3://{name}/products")
    assert from_report.keys == listed.keys and "with space+plus.png" in from_report.keys
    assert "shoes/.png" in listed.keys  # an image by its suffix either way
    report, listing = from_report.read(), listed.read()  # both spilled to local Parquet files as read
    assert report.drop(["mtime"]).equals(listing.drop(["mtime"])), "sizes, etags, classes"
    seconds = zip(report["mtime"].to_pylist(), listing["mtime"].to_pylist())
    assert all(abs(a - b) < 1 for a, b in seconds), "the same modification times (to the report's precision)"
    assert from_report.skipped == listed.skipped == 1


def test_a_report_that_does_not_match_its_manifest_lists_nothing(bucket):
    fs, name = bucket
    manifest = write_report(fs, name, inventory_rows(fs, name), "CSV")
    fs.pipe(f"{name}-inventory/inv/shop/daily/data/a1.csv.gz", gzip.compress(b'"x","y"\n'))
    with pytest.raises(InventoryError, match="does not match the MD5"):
        read_inventory(manifest, f"s3://{name}/products")
    with pytest.raises(InventoryError, match="lists bucket"):
        read_inventory(manifest, "s3://another-bucket/products")


@pytest.mark.usefixtures("prefect_harness")
def test_a_run_from_the_inventory_then_a_list_run_reads_nothing_again(bucket, tmp_path):
    fs, name = bucket
    manifest = write_report(fs, name, inventory_rows(fs, name), "CSV")
    run = {"catalogue": f"s3://{name}/products", "store": str(tmp_path / "store"), "model": "raw-pixels",
           "batch_size": "8"}
    first = ingest(IngestConfig(**run, inventory=manifest))
    assert first["listed"] == 14 and first["encoded"] == 14
    again = ingest(IngestConfig(**run))
    assert again["listed"] == 14 and again["unchanged"] == 14 and again["encoded"] == 0  # the same items


def test_a_manifest_that_is_not_one_or_names_an_unread_format_lists_nothing(tmp_path):
    bad = tmp_path / "garbage" / "manifest.json"
    bad.parent.mkdir()
    bad.write_text("{not json")
    with pytest.raises(InventoryError, match="not an S3 Inventory manifest"):
        read_inventory(str(bad), "s3://shop/products")
    odd = tmp_path / "odd" / "manifest.json"
    odd.parent.mkdir()
    odd.write_text(json.dumps({"sourceBucket": "shop", "destinationBucket": "arn:aws:s3:::inv",
                               "fileFormat": "Avro", "files": []}))
    with pytest.raises(InventoryError, match="imgest reads CSV, Parquet, ORC"):
        read_inventory(str(odd), "s3://shop/products")


def test_a_report_file_is_decoded_and_spilled_a_batch_at_a_time(tmp_path, monkeypatch):
    """A Parquet data file of a large bucket holds millions of rows: it is read a batch at a time and each
    batch's images go to the listing's file as they come (its row groups show it), never the file's table
    whole. A copy of the report on a file system reads as the bucket's would."""
    from imgest.tasks.ingest import inventory

    monkeypatch.setattr(inventory, "BATCH_ROWS", 100)
    keys = [f"catalogue/p/{i:05d}.{'jpg' if i % 10 else 'txt'}" for i in range(1000)]
    sink = io.BytesIO()
    pq.write_table(pa.table({"bucket": ["shop"] * 1000, "key": keys, "size": list(range(1000)),
                             "e_tag": [f"e{i}" for i in range(1000)]}), sink, row_group_size=250)
    data = sink.getvalue()
    (tmp_path / "inv" / "data").mkdir(parents=True)
    (tmp_path / "inv" / "data" / "a.parquet").write_bytes(data)
    entry = {"key": "inv/data/a.parquet", "size": len(data), "MD5checksum": hashlib.md5(data).hexdigest()}
    manifest = {"sourceBucket": "shop", "destinationBucket": "arn:aws:s3:::inventory", "fileFormat": "Parquet",
                "files": [entry]}
    (tmp_path / "inv" / "manifest.json").write_text(json.dumps(manifest))

    listing = read_inventory(str(tmp_path / "inv" / "manifest.json"), "s3://shop/catalogue")

    spilled = pq.ParquetFile(listing.files[0])
    assert spilled.metadata.num_rows == 900 and listing.skipped == 100
    assert spilled.num_row_groups == 10, "one row group per batch of 100 rows: written as read"
    assert listing.read()["key"].to_pylist() == sorted(k[len("catalogue/"):] for k in keys if k.endswith(".jpg"))
