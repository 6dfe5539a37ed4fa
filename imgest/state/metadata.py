"""Catalogue metadata: one row per item beside the images (item_id, product_id, title, caption, attributes).

Read from Parquet, CSV or JSONL (a path or any fsspec URL), checked, and kept in the store as immutable
snapshots `metadata/snapshots/<seq>.parquet`: a new one is written only when a row changed (each row
carries the hash of its content), so the nightly costs nothing when the table did not move. Rows for
items the catalogue does not have, and items without a row, are counted and reported, never fatal; a
malformed file is one error naming its line. Nothing read is executed: CSV and JSON are parsed as data.

The file is untrusted and its size is checked before it costs memory: at most MAX_METADATA_BYTES are
read (a longer file is refused without reading the rest), then MAX_METADATA_COLUMNS columns (a CSV's
header line, a Parquet footer, each JSONL line's keys), MAX_METADATA_CELLS rows x columns (what the
Python rows cost: ~250 bytes a cell, measured), MAX_CELL_CHARS characters a cell, MAX_LINE_CHARS a JSONL
line and MAX_JSON_DEPTH levels of nesting in a JSONL value; each limit is one error naming it.
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

from imgest.errors import UserError
from imgest.records import depth
from imgest.state.clock import now_iso
from imgest.storage import Location, redact

SNAPSHOTS = "metadata/snapshots"
TEXT_COLUMNS = ("title", "caption", "description")
FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl",
           ".json": "jsonl"}
MAX_METADATA_BYTES = 512 << 20  # the file; for Parquet also its data uncompressed and its text decoded
MAX_METADATA_COLUMNS = 1_000
MAX_METADATA_CELLS = 20_000_000  # rows x columns: 2M items x 10 columns, ~5 GB as Python rows
MAX_CELL_CHARS = 131_072  # a title or a description; also the csv module's own default field limit
MAX_LINE_CHARS = 1 << 20  # one JSONL line: one item
MAX_JSON_DEPTH = 32  # a JSONL value's nesting (lists and objects); Python's parser recurses


class MetadataError(UserError, ValueError):
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
    _check_columns(len(header), url, "line 1: the header has")
    rows = []
    try:
        for cells in reader:
            if not cells:
                continue
            if len(cells) != len(header):
                raise MetadataError(f"{redact(url)} line {reader.line_num}: {len(cells)} fields, the header has "
                                    f"{len(header)}")
            if (len(rows) + 1) * len(header) > MAX_METADATA_CELLS:
                _too_many_cells(url, f"line {reader.line_num}")
            longest = max(map(len, cells))
            if longest > MAX_CELL_CHARS:
                raise MetadataError(f"{redact(url)} line {reader.line_num}: a field of {longest} characters; the "
                                    f"limit is {MAX_CELL_CHARS} (MAX_CELL_CHARS)")
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
    rows, names, cells = [], set(), 0
    try:
        text = data.decode("utf-8-sig", errors="strict")
    except UnicodeDecodeError as exc:
        raise MetadataError(f"{redact(url)}: not UTF-8 text ({exc})") from exc
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if len(line) > MAX_LINE_CHARS:
            raise MetadataError(f"{redact(url)} line {number}: {len(line)} characters; the limit is "
                                f"{MAX_LINE_CHARS} (MAX_LINE_CHARS)")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise MetadataError(f"{redact(url)} line {number}: not JSON ({exc.msg})") from exc
        except RecursionError as exc:  # deeper than Python's parser goes: deeper than MAX_JSON_DEPTH too
            raise MetadataError(f"{redact(url)} line {number}: nested deeper than {MAX_JSON_DEPTH} levels "
                                "(MAX_JSON_DEPTH)") from exc
        if not isinstance(obj, dict):
            raise MetadataError(f"{redact(url)} line {number}: expected one JSON object per line")
        if depth(obj, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
            raise MetadataError(f"{redact(url)} line {number}: nested deeper than {MAX_JSON_DEPTH} levels "
                                "(MAX_JSON_DEPTH)")
        names.update(obj)
        _check_columns(len(names), url, f"line {number}: the lines so far have")
        cells += len(obj)
        if cells > MAX_METADATA_CELLS:
            _too_many_cells(url, f"line {number}")
        rows.append(obj | {"_line": number})
    return rows


def _check_columns(count: int, url: str, where: str) -> None:
    if count > MAX_METADATA_COLUMNS:
        raise MetadataError(f"{redact(url)} {where} {count} columns; the limit is {MAX_METADATA_COLUMNS} "
                            "(MAX_METADATA_COLUMNS)")


def _too_many_cells(url: str, where: str) -> None:
    raise MetadataError(f"{redact(url)} {where}: more than {MAX_METADATA_CELLS} cells (rows x columns; the limit "
                        "is MAX_METADATA_CELLS)")


def _read_file(url: str) -> bytes:
    """The file's bytes, reading at most one byte past MAX_METADATA_BYTES: a longer file is refused unread."""
    try:
        data = Location(url).read_bytes("", limit=MAX_METADATA_BYTES + 1)
    except (FileNotFoundError, IsADirectoryError) as exc:
        raise MetadataError(f"{redact(url)} does not exist (or is not a file)") from exc
    if len(data) > MAX_METADATA_BYTES:
        raise MetadataError(f"{redact(url)}: larger than the limit of {MAX_METADATA_BYTES} bytes "
                            "(MAX_METADATA_BYTES)")
    return data


def _is_text(kind: pa.DataType) -> bool:
    return (pa.types.is_string(kind) or pa.types.is_binary(kind) or pa.types.is_large_string(kind)
            or pa.types.is_large_binary(kind))


def _parquet_table(data: bytes, url: str) -> pa.Table:
    """A Parquet file's table, its footer checked first (columns, cells, uncompressed size); text columns
    read as dictionaries and their decoded size checked before a cell becomes a Python string."""
    import pyarrow.compute as pc

    # Arrow reads from its own buffer, never through a Python file object: Arrow's reader threads calling back
    # into Python can outlive the read and abort the interpreter at exit (apache/arrow#34314, #50482)
    source = pa.py_buffer(data)
    try:
        with pq.ParquetFile(pa.BufferReader(source)) as file:
            meta, schema = file.metadata, file.schema_arrow
    except Exception as exc:  # noqa: BLE001 - pyarrow's many error types: one message
        raise MetadataError(f"{redact(url)}: not a readable Parquet file ({exc})") from exc
    _check_columns(max(meta.num_columns, len(schema.names)), url, "has")
    if meta.num_rows * len(schema.names) > MAX_METADATA_CELLS:
        _too_many_cells(url, f"has {meta.num_rows} rows x {len(schema.names)} columns")
    unpacked = sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
    if unpacked > MAX_METADATA_BYTES:
        raise MetadataError(f"{redact(url)}: {unpacked} bytes of data uncompressed; the limit is "
                            f"{MAX_METADATA_BYTES} (MAX_METADATA_BYTES)")
    text = [f.name for f in schema if _is_text(f.type.value_type if pa.types.is_dictionary(f.type) else f.type)]
    try:
        table = pq.read_table(pa.BufferReader(source), read_dictionary=text)  # each distinct string once
    except Exception as exc:  # noqa: BLE001
        raise MetadataError(f"{redact(url)}: not a readable Parquet file ({exc})") from exc
    decoded = table.nbytes
    for name in text:
        for chunk in table.column(name).chunks:
            coded = pa.types.is_dictionary(chunk.type)
            lengths = pc.binary_length(chunk.dictionary if coded else chunk)
            longest = pc.max(lengths).as_py() or 0
            if longest > MAX_CELL_CHARS:
                raise MetadataError(f"{redact(url)}: column {name!r} has a value of {longest} bytes; the limit is "
                                    f"{MAX_CELL_CHARS} (MAX_CELL_CHARS)")
            if coded:  # what the repeated strings cost once each row has its own
                decoded += pc.sum(pc.take(lengths, chunk.indices)).as_py() or 0
    if decoded > MAX_METADATA_BYTES:
        raise MetadataError(f"{redact(url)}: {decoded} bytes decoded; the limit is {MAX_METADATA_BYTES} "
                            "(MAX_METADATA_BYTES)")
    return table


def read_metadata(url: str) -> pa.Table:
    """The metadata table, checked: item_id present, non-empty and unique; text columns as strings; a
    row_hash of each row's content. Raises MetadataError naming the line of the first problem."""
    fmt = _format(url)
    data = _read_file(url)
    if fmt == "parquet":
        table = _parquet_table(data, url)
        del data
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
