"""Catalogue metadata: one row per item beside the images (item_id, product_id, title, caption, attributes).

Read from Parquet, CSV or JSONL (a path or any fsspec URL), checked, and kept in the store as immutable
snapshots `metadata/snapshots/<seq>.parquet`: a new one is written only when a row changed (each row
carries the hash of its content), so the nightly costs nothing when the table did not move. Rows for
items the catalogue does not have, and items without a row, are counted and reported, never fatal; a
malformed file is one error naming its line. Nothing read is executed: CSV and JSON are parsed as data.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import posixpath
from dataclasses import asdict, dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from imgest.storage import Location, read_url, redact
from imgest.tasks.state import now_iso

SNAPSHOTS = "metadata/snapshots"
TEXT_COLUMNS = ("title", "caption", "description")
FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl",
           ".json": "jsonl"}


class MetadataError(ValueError):
    """The metadata file cannot be used as it is; the message names the file and, where it can, the line."""


class NoMetadataError(MetadataError):
    """A text model was asked to ingest a store that holds no catalogue metadata."""


@dataclass
class MetadataReport:
    source: str
    rows: int
    new: int = 0
    changed: int = 0
    removed: int = 0
    unchanged: int = 0
    unknown_items: int = 0  # rows whose item_id the catalogue listing does not have
    unknown_examples: list[str] | None = None
    without_row: int = 0  # listed images without a metadata row
    without_row_examples: list[str] | None = None
    snapshot_seq: int = 0
    written: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def _format(url: str) -> str:
    ext = posixpath.splitext(url.split("?", 1)[0].lower())[1]
    if ext not in FORMATS:
        raise MetadataError(f"{redact(url)}: unknown metadata format {ext or '(no extension)'!r}; use .parquet, "
                            ".csv or .jsonl")
    return FORMATS[ext]


def _typed(values: list) -> list:
    """CSV cells are text: a column whose every non-empty cell is an integer (or a number) becomes one, so
    `price < 50` compares numbers; anything else stays text. Empty cells are nulls."""
    cells = [None if v is None or v == "" else v for v in values]
    present = [v for v in cells if v is not None]
    for cast in (int, float):
        try:
            return [None if v is None else cast(v) for v in cells] if present else cells
        except (TypeError, ValueError):
            continue
    return cells


def _rows_from_csv(data: bytes, url: str) -> list[dict]:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise MetadataError(f"{redact(url)}: not UTF-8 text ({exc})") from exc
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        header = next(reader)
    except StopIteration as exc:
        raise MetadataError(f"{redact(url)}: empty file, expected a header line") from exc
    except csv.Error as exc:
        raise MetadataError(f"{redact(url)} line 1: {exc}") from exc
    rows = []
    try:
        for cells in reader:
            if not cells:
                continue
            if len(cells) != len(header):
                raise MetadataError(f"{redact(url)} line {reader.line_num}: {len(cells)} fields, the header has "
                                    f"{len(header)}")
            rows.append(dict(zip(header, cells)) | {"_line": reader.line_num})
    except csv.Error as exc:
        raise MetadataError(f"{redact(url)} line {reader.line_num}: {exc}") from exc
    text = ("item_id", "product_id", *TEXT_COLUMNS)  # ids keep their leading zeros; titles stay text
    columns = {name: [r[name] or None for r in rows] if name in text else _typed([r[name] for r in rows])
               for name in header}
    for n, row in enumerate(rows):
        for name in header:
            row[name] = columns[name][n]
    return rows


def _rows_from_jsonl(data: bytes, url: str) -> list[dict]:
    rows = []
    for number, line in enumerate(data.decode("utf-8-sig", errors="strict").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise MetadataError(f"{redact(url)} line {number}: not JSON ({exc.msg})") from exc
        if not isinstance(obj, dict):
            raise MetadataError(f"{redact(url)} line {number}: expected one JSON object per line")
        rows.append(obj | {"_line": number})
    return rows


def read_metadata(url: str) -> pa.Table:
    """The metadata table, checked: item_id present, non-empty and unique; text columns as strings; a
    row_hash of each row's content. Raises MetadataError naming the line of the first problem."""
    fmt = _format(url)
    data = read_url(url)
    if fmt == "parquet":
        try:
            table = pq.read_table(io.BytesIO(data))
        except Exception as exc:  # noqa: BLE001 - pyarrow's many error types: one message
            raise MetadataError(f"{redact(url)}: not a readable Parquet file ({exc})") from exc
        rows = [r | {"_line": n} for n, r in enumerate(table.to_pylist(), 1)]
        where = "row"
    else:
        rows = _rows_from_csv(data, url) if fmt == "csv" else _rows_from_jsonl(data, url)
        where = "line"
    seen: dict[str, int] = {}
    for row in rows:
        line = row.pop("_line")
        item = row.get("item_id")
        if item is None or str(item).strip() == "":
            raise MetadataError(f"{redact(url)} {where} {line}: no item_id")
        row["item_id"] = item = str(item)
        if item in seen:
            raise MetadataError(f"{redact(url)} {where} {line}: item_id {item!r} again (first at {where} "
                                f"{seen[item]}); one row per item")
        seen[item] = line
        for name in ("product_id", *TEXT_COLUMNS):
            if row.get(name) is not None:
                row[name] = str(row[name])
        content = {k: v for k, v in row.items() if v is not None}  # an absent cell and a null are the same
        row["row_hash"] = hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()
    names = ["item_id", "product_id", *TEXT_COLUMNS]
    names += sorted({k for r in rows for k in r} - set(names) - {"row_hash"}) + ["row_hash"]
    try:
        table = pa.Table.from_pylist([{n: r.get(n) for n in names} for r in rows])
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise MetadataError(f"{redact(url)}: a column mixes types ({exc})") from exc
    return table.sort_by("item_id")


def snapshot_key(seq: int) -> str:
    return f"{SNAPSHOTS}/{seq:08d}.parquet"


def latest_seq(store: Location) -> int:
    names = [n for n in store.list_names(SNAPSHOTS) if n.endswith(".parquet") and n[:-8].isdigit()]
    return max((int(n[:-8]) for n in names), default=0)


def load_metadata(store: Location) -> pa.Table | None:
    """The latest stored metadata snapshot, or None when the store has none."""
    seq = latest_seq(store)
    return store.read_table(snapshot_key(seq)) if seq else None


def store_metadata(store: Location, url: str, table: pa.Table, listed: set[str] | None) -> MetadataReport:
    """Compare with the last snapshot; write the next one only if a row is new, changed or gone. Call with
    the store lock held (the ingest's)."""
    report = MetadataReport(source=redact(url), rows=table.num_rows)
    ids = table.column("item_id").to_pylist()
    if listed is not None:
        unknown = [i for i in ids if i not in listed]
        missing = sorted(listed - set(ids))
        report.unknown_items, report.unknown_examples = len(unknown), unknown[:10]
        report.without_row, report.without_row_examples = len(missing), missing[:10]
    seq = latest_seq(store)
    previous = {}
    if seq:
        old = store.read_table(snapshot_key(seq), columns=["item_id", "row_hash"])
        previous = dict(zip(old.column("item_id").to_pylist(), old.column("row_hash").to_pylist()))
    hashes = dict(zip(ids, table.column("row_hash").to_pylist()))
    report.new = sum(1 for i in hashes if i not in previous)
    report.changed = sum(1 for i, h in hashes.items() if i in previous and previous[i] != h)
    report.unchanged = len(hashes) - report.new - report.changed
    report.removed = sum(1 for i in previous if i not in hashes)
    report.snapshot_seq = seq
    if report.new or report.changed or report.removed or not seq:
        report.snapshot_seq, report.written = seq + 1, True
        meta = {"imgest.source": report.source, "imgest.created": now_iso(), "imgest.rows": str(table.num_rows),
                "imgest.report": json.dumps(report.to_dict(), sort_keys=True)}
        store.write_table(snapshot_key(seq + 1), table.replace_schema_metadata(meta))
    return report
