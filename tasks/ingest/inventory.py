"""An S3 Inventory report (its manifest.json and the CSV, Parquet or ORC files it names) read as the catalogue's
listing, instead of LIST: the way operators of large buckets already enumerate them, at no request cost.

The report is a snapshot S3 writes daily or weekly: objects written since it was made are picked up by the
next report. Each data file is checked against the MD5 the manifest gives before a row of it is used, and
everything is parsed as data (JSON, CSV, Parquet, ORC), never executed or unpickled.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
from collections.abc import Iterable, Iterator
from urllib.parse import unquote_plus

import pyarrow as pa
import pyarrow.compute as pc

from imgest.errors import UserError
from imgest.images.listing import IMAGE_EXTENSIONS, LISTING_SCHEMA, Listing, SpillFolder
from imgest.storage import read_url

FORMATS = ("CSV", "Parquet", "ORC")
# CSV header names (the manifest's fileSchema) -> the Parquet/ORC column names S3 uses
COLUMNS = {"Bucket": "bucket", "Key": "key", "VersionId": "version_id", "IsLatest": "is_latest",
           "IsDeleteMarker": "is_delete_marker", "Size": "size", "LastModifiedDate": "last_modified_date",
           "ETag": "e_tag", "StorageClass": "storage_class"}


class InventoryError(UserError, ValueError):
    """The manifest or a data file cannot be used; nothing was listed."""


def _bucket_and_prefix(catalogue_url: str) -> tuple[str, str]:
    if not catalogue_url.startswith(("s3://", "s3a://")):
        raise InventoryError(f"an S3 Inventory lists an S3 bucket; the catalogue is {catalogue_url}")
    path = catalogue_url.split("://", 1)[1].strip("/")
    bucket, _, prefix = path.partition("/")
    return bucket, prefix


def read_manifest(manifest_url: str) -> dict:
    try:
        manifest = json.loads(read_url(manifest_url))
        fmt, files = manifest["fileFormat"], manifest["files"]
        bucket = manifest["destinationBucket"].rsplit(":", 1)[-1]
        [(f["key"], f["MD5checksum"]) for f in files]
    except (ValueError, KeyError, TypeError) as exc:
        raise InventoryError(f"{manifest_url} is not an S3 Inventory manifest.json: {exc}") from exc
    if fmt not in FORMATS:
        raise InventoryError(f"inventory format {fmt!r}; imgest reads {', '.join(FORMATS)}")
    return {**manifest, "_bucket": bucket}


def _data_url(manifest_url: str, manifest: dict, key: str) -> str:
    """Where a data file is: in the destination bucket; for a copy of that bucket on a file system, below the
    folder that holds the manifest's own key path."""
    if manifest_url.startswith(("s3://", "s3a://")):
        return f"s3://{manifest['_bucket']}/{key}"
    root = os.path.dirname(manifest_url.removeprefix("file://"))
    while not os.path.exists(os.path.join(root, key)) and os.path.dirname(root) != root:
        root = os.path.dirname(root)
    return os.path.join(root, key)


BATCH_ROWS = 65_536  # rows of a Parquet data file decoded at a time


def _read_file(data: bytes, fmt: str, schema: list[str]) -> Iterator[pa.Table]:
    """A data file's rows, as tables: a Parquet file a batch at a time (decoded, a report file of millions of
    rows would take several times its size in memory); CSV and ORC whole."""
    if fmt == "CSV":
        import pyarrow.csv as csv

        text = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
        table = csv.read_csv(io.BytesIO(text), read_options=csv.ReadOptions(column_names=schema),
                             convert_options=csv.ConvertOptions(column_types={n: pa.string() for n in schema}))
        table = table.rename_columns([COLUMNS.get(n, n.lower()) for n in schema])
        keys = [unquote_plus(k) for k in table["key"].to_pylist()]  # CSV inventories URL-encode keys
        yield table.set_column(table.schema.get_field_index("key"), "key", pa.array(keys, pa.string()))
    elif fmt == "Parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(io.BytesIO(data)).iter_batches(BATCH_ROWS):
            yield pa.Table.from_batches([batch])
    else:
        import pyarrow.orc as orc

        yield orc.ORCFile(io.BytesIO(data)).read()


def _truthy(column) -> pa.Array:
    if pa.types.is_boolean(column.type):
        return pc.fill_null(column, False)
    return pc.equal(pc.utf8_lower(pc.fill_null(column.cast(pa.string()), "false")), "true")


def _seconds(column) -> pa.Array:
    """LastModifiedDate (an ISO string in CSV, a timestamp in Parquet/ORC) -> POSIX seconds."""
    if not pa.types.is_timestamp(column.type):
        column = pc.cast(pc.replace_substring(column.cast(pa.string()), "Z", ""), pa.timestamp("us"))
    return pc.divide(pc.cast(pc.cast(column, pa.timestamp("us")), pa.int64()).cast(pa.float64()), 1e6)


def _listing_rows(table: pa.Table, below: str) -> pa.Table:
    """An inventory table's rows below the prefix, in LISTING_SCHEMA (keys relative to the prefix)."""
    def text(name: str) -> pa.Array:  # a column as strings, "" (CSV's empty field) as null
        if name not in table.column_names:
            return pa.nulls(len(table), pa.string())
        values = table[name].cast(pa.string())
        return pc.if_else(pc.equal(values, ""), pa.scalar(None, pa.string()), values)

    return pa.table({
        "key": pc.utf8_slice_codeunits(table["key"], len(below)),
        "key_ok": pa.array([True] * len(table), pa.bool_()),
        "size": pc.cast(text("size"), pa.int64()),
        "mtime": _seconds(table["last_modified_date"]) if "last_modified_date" in table.column_names
        else pa.nulls(len(table), pa.float64()),
        "etag": text("e_tag"),
        "storage_class": text("storage_class"),
    }, schema=LISTING_SCHEMA)


IMAGE_KEY_REGEX = r"(?i)\.(" + "|".join(e[1:] for e in sorted(IMAGE_EXTENSIONS)) + r")$"


def read_inventory(manifest_url: str, catalogue_url: str) -> Listing:
    """The catalogue's image objects as the inventory lists them: current versions only (no delete markers),
    keys below the catalogue prefix made relative to it, as LIST would give them. Columnar throughout."""
    bucket, prefix = _bucket_and_prefix(catalogue_url)
    manifest = read_manifest(manifest_url)
    if manifest.get("sourceBucket") != bucket:
        raise InventoryError(f"the inventory lists bucket {manifest.get('sourceBucket')!r}, the catalogue is in "
                             f"{bucket!r}")
    schema = [c.strip() for c in manifest.get("fileSchema", "").split(",") if c.strip()]
    if manifest["fileFormat"] == "CSV" and "Key" not in schema:
        raise InventoryError("the manifest's fileSchema has no Key column")
    below = prefix.rstrip("/") + "/" if prefix else ""
    listing = Listing(catalogue=catalogue_url.rstrip("/"), spill=[SpillFolder()])
    for entry in manifest["files"]:
        data = read_url(_data_url(manifest_url, manifest, entry["key"]))
        if hashlib.md5(data).hexdigest() != entry["MD5checksum"]:
            raise InventoryError(f"inventory file {entry['key']} does not match the MD5 in the manifest")
        name = f"inventory-{len(listing.files):05d}.parquet"  # spilled as read: never the whole report in memory
        listing.files.append(listing.spill[0].write(name, _image_rows(
            _read_file(data, manifest["fileFormat"], schema), bucket, below, listing)))
        del data
    return listing


def _image_rows(tables: Iterable[pa.Table], bucket: str, below: str, listing: Listing) -> Iterator[pa.RecordBatch]:
    """The image objects among an inventory file's rows, in LISTING_SCHEMA; the others counted as skipped."""
    for table in tables:
        keep = pc.and_(pc.equal(table["bucket"], bucket), pc.starts_with(table["key"], below))
        keep = pc.and_(keep, pc.invert(pc.ends_with(table["key"], "/")))  # folder placeholders
        if "is_latest" in table.column_names:
            keep = pc.and_(keep, _truthy(table["is_latest"]))
        if "is_delete_marker" in table.column_names:
            keep = pc.and_(keep, pc.invert(_truthy(table["is_delete_marker"])))
        rows = _listing_rows(table.filter(keep), below)
        image = pc.match_substring_regex(rows["key"], IMAGE_KEY_REGEX)
        others = rows.filter(pc.invert(image))["key"]
        listing.skipped += len(others)
        listing.skipped_examples = (listing.skipped_examples + others[:10].to_pylist())[:10]
        yield from rows.filter(image).to_batches()
