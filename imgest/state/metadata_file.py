"""A catalogue metadata file (CSV, JSONL or Parquet), read block by block into Parquet parts on local disk.

The file is untrusted and may hold 100M rows, so nothing here holds a Python object per row: Arrow's readers
parse a block at a time, each block is checked with Arrow compute (item_id present, cell and line lengths,
nesting, column count) and written out as a part, and what needs every row (duplicates, types, the row hash)
is left to DuckDB over the parts. Limits are on a block, a line and a cell, never on the row count.

Each part carries `_row`, the row's ordinal in the file (0-based, blank lines not counted), and for JSONL
`_line`. A problem is one MetadataError naming its line: JSONL knows it; CSV finds it by reading the file
again with Python's strict `csv` module up to that record (only once something is wrong); Parquet names
the row. Nothing read is executed: CSV and JSON are parsed as data.
"""

from __future__ import annotations

import csv
import json
import os
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from imgest.errors import FinalError, UserError
from imgest.storage import Location, redact
from imgest.storage.cache import local_copy
from imgest.storage.records import depth

TEXT_COLUMNS = ("title", "caption", "description")
ID_COLUMNS = ("item_id", "product_id")
FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl",
           ".json": "jsonl"}
MAX_METADATA_COLUMNS = 1_000
MAX_CELL_CHARS = 131_072  # a title or a description (the csv module's own default field limit)
MAX_LINE_CHARS = 1 << 20  # one JSONL line: one item
MAX_JSON_DEPTH = 32  # a JSONL value's nesting (lists and objects)
BLOCK_BYTES = 2 << 20  # CSV and JSONL are parsed this much at a time; a CSV record must fit in one block. Arrow's
# CSV reader holds tens of blocks ahead: 16 MiB blocks held ~0.3 GB at 1M rows, 2 MiB ~80 MB, and parse as fast
MAX_BLOCK_BYTES = 256 << 20  # what one block of Parquet rows decodes to (its text, once each row has its own)
MAX_ROW_GROUP_BYTES = 1 << 30  # a Parquet row group, uncompressed, as its footer says
PARQUET_BATCH_ROWS = 8_192

csv.field_size_limit(max(csv.field_size_limit(), BLOCK_BYTES))  # the locating pass must read what Arrow read


class MetadataError(UserError, FinalError, ValueError):
    """The metadata file cannot be used as it is; the message names the file and, where it can, the line. Not
    retried: the same file fails the same way (a 100M-row file takes minutes a read)."""


@dataclass
class Parts:
    """The file's rows as Parquet parts in `folder`, in file order."""
    url: str
    fmt: str
    local: str  # the file on local disk (the file itself, or a download)
    paths: list[str] = field(default_factory=list)
    rows: int = 0
    ordered: bool = True  # item_ids strictly increasing through the file (so unique, and no sort is needed)
    last_id: str | None = None

    def follow(self, block: pa.Table) -> None:
        """Keep `ordered` up to date with one more block (compared as the snapshot sorts: text, byte order)."""
        if not self.ordered or not block.num_rows:
            return
        ids = pc.cast(block.column("item_id"), pa.string())
        rising = block.num_rows < 2 or pc.all(pc.less(ids.slice(0, block.num_rows - 1), ids.slice(1))).as_py()
        self.ordered = bool(rising) and (self.last_id is None or ids[0].as_py() > self.last_id)
        self.last_id = ids[-1].as_py()

    def where(self, rows: list[int], lines: list[int | None] | None = None) -> list[str]:
        """`line N` (or `row N` for Parquet) for each 0-based row ordinal."""
        if self.fmt == "parquet":
            return [f"row {r + 1}" for r in rows]
        if self.fmt == "jsonl" and lines is not None:
            return [f"line {n}" for n in lines]
        found = _csv_lines(self.local, set(rows))
        return [f"line {found[r]}" if r in found else f"record {r + 1}" for r in rows]

    def error(self, row: int, message: str, line: int | None = None) -> MetadataError:
        return MetadataError(f"{redact(self.url)} {self.where([row], [line])[0]}: {message}")


def file_format(url: str) -> str:
    ext = posixpath.splitext(url.split("?", 1)[0].lower())[1]
    if ext not in FORMATS:
        raise MetadataError(f"{redact(url)}: unknown metadata format {ext or '(no extension)'!r}; use .parquet, "
                            ".csv or .jsonl")
    return FORMATS[ext]


def read_parts(url: str, folder: str) -> Parts:
    """Read, check and write the file's rows as Parquet parts under `folder` (a remote file is first copied
    there: Arrow then reads a local file with its own threads, never a Python file object)."""
    fmt = file_format(url)
    loc = Location(url)
    try:
        if not loc.fs.isfile(loc.path("")):
            raise FileNotFoundError(url)
        local = local_copy(loc, "", os.path.join(folder, "download"), checksum="", suffix="." + fmt)
    except (FileNotFoundError, IsADirectoryError) as exc:
        raise MetadataError(f"{redact(url)} does not exist (or is not a file)") from exc
    parts = Parts(url, fmt, local)
    blocks = {"csv": _csv_blocks, "jsonl": _jsonl_blocks, "parquet": _parquet_blocks}[fmt](parts)
    writer = None
    try:
        for block in blocks:  # one part while the blocks' columns agree (JSONL's may not: Arrow types each block)
            if writer is None or block.schema != writer.schema:
                if writer is not None:
                    writer.close()
                parts.paths.append(os.path.join(folder, f"part-{len(parts.paths):06d}.parquet"))
                writer = pq.ParquetWriter(parts.paths[-1], block.schema, compression="zstd")
            writer.write_table(block)
            parts.rows += block.num_rows
    finally:
        if writer is not None:
            writer.close()
        pa.default_memory_pool().release_unused()  # the blocks' memory back before DuckDB takes its share
    return parts


# -- checks on one block ----------------------------------------------------------------------------------
def _check_columns(count: int, url: str, where: str) -> None:
    if count > MAX_METADATA_COLUMNS:
        raise MetadataError(f"{redact(url)} {where} {count} columns; the limit is {MAX_METADATA_COLUMNS} "
                            "(MAX_METADATA_COLUMNS)")


def _missing_id(block: pa.Table) -> int | None:
    """The block index of the first row without an item_id (absent, null or blank), or None."""
    if "item_id" not in block.column_names:
        return 0 if block.num_rows else None
    ids = block.column("item_id")
    if pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type):
        blank = pc.or_kleene(pc.is_null(ids), pc.equal(pc.utf8_trim_whitespace(ids), ""))
    else:
        blank = pc.is_null(ids)
    blank = pc.fill_null(blank, True)
    return pc.index(blank, True).as_py() if pc.any(blank).as_py() else None


def _long_cell(block: pa.Table) -> tuple[int, str, int] | None:
    """(row, column, characters) of the first text cell longer than MAX_CELL_CHARS, or None."""
    worst = None
    for name in block.column_names:
        column = block.column(name)
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            continue
        lengths = pc.utf8_length(column)
        if (pc.max(lengths).as_py() or 0) > MAX_CELL_CHARS:
            row = pc.index(pc.greater(lengths, MAX_CELL_CHARS), True).as_py()
            if worst is None or row < worst[0]:
                worst = (row, name, lengths[row].as_py())
    return worst


def _numbered(block: pa.Table, first: int) -> pa.Table:
    return block.append_column("_row", pa.array(np.arange(first, first + block.num_rows, dtype=np.int64)))


def _checked(parts: Parts, block: pa.Table, first: int, lines: np.ndarray | None = None) -> pa.Table:
    """The block with its row ordinals (and lines), after the checks every format shares."""
    line = (lambda i: int(lines[i])) if lines is not None else (lambda i: None)
    if (bad := _missing_id(block)) is not None:
        raise parts.error(first + bad, "no item_id", line(bad))
    if (long := _long_cell(block)) is not None:
        row, name, chars = long
        raise parts.error(first + row, f"a field of {chars} characters in column {name!r}; the limit is "
                                       f"{MAX_CELL_CHARS} (MAX_CELL_CHARS)", line(row))
    parts.follow(block)
    block = _numbered(block, first)
    return block.append_column("_line", pa.array(lines, pa.int64())) if lines is not None else block


# -- CSV ----------------------------------------------------------------------------------------------------
def _csv_header(parts: Parts) -> list[str]:
    try:
        with open(parts.local, encoding="utf-8-sig", newline="") as fh:
            header = next(csv.reader(fh, strict=True))
    except StopIteration as exc:
        raise MetadataError(f"{redact(parts.url)}: empty file, expected a header line") from exc
    except csv.Error as exc:
        raise MetadataError(f"{redact(parts.url)} line 1: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise MetadataError(f"{redact(parts.url)}: not UTF-8 text ({exc})") from exc
    _check_columns(len(header), parts.url, "line 1: the header has")
    seen = set()
    for name in header:
        if name in seen:
            raise MetadataError(f"{redact(parts.url)} line 1: column {name!r} twice in the header")
        seen.add(name)
    return header


def _quotes_balanced(path: str) -> bool:
    """An even number of quote characters: Arrow's reader takes an unclosed quote to the end of the file as
    one value, where the file is malformed."""
    count = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(BLOCK_BYTES):
            count += chunk.count(b'"')
    return count % 2 == 0


def _csv_blocks(parts: Parts) -> Iterator[pa.Table]:
    import pyarrow.csv as pcsv

    header = _csv_header(parts)
    if not _quotes_balanced(parts.local):
        _raise_csv_problem(parts, len(header), "an unclosed quote")
    invalid: list = []

    def on_invalid(row) -> str:  # a record with the wrong number of fields: one error naming its line
        invalid.append(row)
        return "error"

    # every cell read as text; the types are decided over the whole column once it is read (DuckDB)
    options = dict(
        read_options=pcsv.ReadOptions(block_size=BLOCK_BYTES),
        parse_options=pcsv.ParseOptions(newlines_in_values=True, invalid_row_handler=on_invalid),
        convert_options=pcsv.ConvertOptions(column_types={name: pa.string() for name in header}, null_values=[""],
                                            strings_can_be_null=True, quoted_strings_can_be_null=True,
                                            check_utf8=True))
    first = 0
    try:
        with pcsv.open_csv(parts.local, **options) as reader:  # it reads the first block already
            for batch in reader:
                block = pa.Table.from_batches([batch])
                yield _checked(parts, block, first)
                first += block.num_rows
    except pa.ArrowInvalid as exc:
        if invalid and invalid[0].number is not None:
            row = invalid[0]
            raise MetadataError(f"{redact(parts.url)} line {row.number}: {row.actual_columns} fields, the header "
                                f"has {row.expected_columns}") from exc
        _raise_csv_problem(parts, len(header), str(exc))


def _csv_records(path: str) -> Iterator[tuple[int, int, list[str]]]:
    """(ordinal, line, cells) of each non-empty record after the header, as Python's strict csv reads them."""
    with open(path, encoding="utf-8-sig", newline="") as fh:
        reader = csv.reader(fh, strict=True)
        next(reader, None)
        ordinal = 0
        for cells in reader:
            if cells:
                yield ordinal, reader.line_num, cells
                ordinal += 1


def _csv_lines(path: str, rows: set[int]) -> dict[int, int]:
    """The line each record ordinal ends on (only called once something is wrong)."""
    found: dict[int, int] = {}
    if not rows:
        return found
    last = max(rows)
    try:
        for ordinal, line, _ in _csv_records(path):
            if ordinal in rows:
                found[ordinal] = line
            if ordinal >= last:
                break
    except (csv.Error, UnicodeDecodeError):
        pass
    return found


def _raise_csv_problem(parts: Parts, columns: int, arrow_said: str) -> None:
    """Find the first malformed record with Python's strict csv reader and raise it; Arrow's words otherwise."""
    url = redact(parts.url)
    line = 1
    try:
        with open(parts.local, encoding="utf-8-sig", newline="") as fh:
            reader = csv.reader(fh, strict=True)
            next(reader, None)
            for cells in reader:
                line = reader.line_num
                if cells and len(cells) != columns:
                    raise MetadataError(f"{url} line {line}: {len(cells)} fields, the header has {columns}")
                if cells and sum(map(len, cells)) + len(cells) > BLOCK_BYTES:
                    raise MetadataError(f"{url} line {line}: a record longer than {BLOCK_BYTES} bytes (BLOCK_BYTES)")
    except csv.Error as exc:
        raise MetadataError(f"{url} line {line + 1}: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise MetadataError(f"{url}: not UTF-8 text ({exc})") from exc
    raise MetadataError(f"{url}: {arrow_said}")


# -- JSONL --------------------------------------------------------------------------------------------------
WHITESPACE = np.array([9, 10, 13, 32], np.uint8)


def _line_blocks(path: str) -> Iterator[tuple[bytes, int]]:
    """(block, number of its first line): whole lines, about BLOCK_BYTES at a time, a UTF-8 BOM dropped."""
    line, carry = 1, b""
    with open(path, "rb") as fh:
        head = fh.read(3)
        carry = head[3:] if head.startswith(b"\xef\xbb\xbf") else head
        while True:
            chunk = fh.read(BLOCK_BYTES)
            data = carry + chunk
            if not chunk:
                if data:
                    yield data, line
                return
            cut = data.rfind(b"\n") + 1
            if cut == 0 and len(data) <= MAX_LINE_CHARS * 4:  # a line still being read: read on
                carry = data
                continue
            if cut == 0:  # a line past any limit: hand it over alone, the length check refuses it
                cut = len(data)
            yield data[:cut], line
            line += data.count(b"\n", 0, cut)
            carry = data[cut:]


def _jsonl_blocks(parts: Parts) -> Iterator[pa.Table]:
    import pyarrow.json as pjson

    names: set[str] = set()
    first = 0
    for data, first_line in _line_blocks(parts.local):
        raw = np.frombuffer(data, np.uint8)
        ends = np.flatnonzero(raw == 10)
        ends = np.append(ends, len(raw)) if len(raw) and raw[-1] != 10 else ends
        starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
        # per line, from byte masks (one byte a byte): has it text, how many `[` and `{` (a bound on its nesting)
        content = np.flatnonzero(np.logical_or.reduceat(~np.isin(raw, WHITESPACE), starts)) if len(raw) else starts
        openers = np.add.reduceat((raw == ord("[")) | (raw == ord("{")), starts, dtype=np.int32) if len(raw) else starts
        too_long = np.flatnonzero(ends - starts > MAX_LINE_CHARS)
        suspects = np.flatnonzero(openers > MAX_JSON_DEPTH)  # only those can nest deeper than the limit
        if len(too_long) or len(suspects):
            for i in sorted({*too_long.tolist(), *suspects.tolist()}):
                _check_jsonl_line(parts.url, data[starts[i]:ends[i]], first_line + int(i), names, {})
        try:
            block = pjson.read_json(pa.BufferReader(data), read_options=pjson.ReadOptions(
                use_threads=False, block_size=max(len(data), 1 << 16)))
        except pa.ArrowInvalid as exc:
            _raise_jsonl_problem(parts.url, data, first_line, names, str(exc))
        if block.num_rows != len(content):  # the lines Arrow read are not the lines with content
            _raise_jsonl_problem(parts.url, data, first_line, names, "lines and rows do not match")
        if len(names | set(block.column_names)) > MAX_METADATA_COLUMNS:
            _raise_jsonl_problem(parts.url, data, first_line, names, "too many columns")
        names.update(block.column_names)
        yield _checked(parts, block, first, first_line + content)
        first += block.num_rows


def _kind(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "boolean"
    return {int: "number", float: "number", str: "string", list: "list", dict: "object"}[type(value)]


def _check_jsonl_line(url: str, line: bytes, number: int, names: set[str], kinds: dict[str, str]) -> None:
    where = f"{redact(url)} line {number}"
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MetadataError(f"{where}: not UTF-8 text ({exc})") from exc
    if not text.strip():
        return
    if len(text) > MAX_LINE_CHARS:
        raise MetadataError(f"{where}: {len(text)} characters; the limit is {MAX_LINE_CHARS} (MAX_LINE_CHARS)")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MetadataError(f"{where}: not JSON ({exc.msg})") from exc
    except RecursionError as exc:  # deeper than Python's parser goes: deeper than MAX_JSON_DEPTH too
        raise MetadataError(f"{where}: nested deeper than {MAX_JSON_DEPTH} levels (MAX_JSON_DEPTH)") from exc
    if not isinstance(obj, dict):
        raise MetadataError(f"{where}: expected one JSON object per line")
    if depth(obj, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise MetadataError(f"{where}: nested deeper than {MAX_JSON_DEPTH} levels (MAX_JSON_DEPTH)")
    names.update(obj)
    _check_columns(len(names), url, f"line {number}: the lines so far have")
    for name, value in obj.items():
        kind = _kind(value)
        if kind is not None and kinds.setdefault(name, kind) != kind:
            raise MetadataError(f"{where}: column {name!r} holds a {kind} here and a {kinds[name]} before; one "
                                "type a column")


def _raise_jsonl_problem(url: str, data: bytes, first_line: int, names: set[str], arrow_said: str) -> None:
    """Read the block line by line with Python's json and raise its first problem; Arrow's words otherwise."""
    seen, kinds = set(names), {}
    for offset, line in enumerate(data.split(b"\n")):
        _check_jsonl_line(url, line, first_line + offset, seen, kinds)
    last = first_line + data.count(b"\n")
    raise MetadataError(f"{redact(url)} lines {first_line}-{last}: {arrow_said}")


# -- Parquet ------------------------------------------------------------------------------------------------
def _is_text(kind: pa.DataType) -> bool:
    return (pa.types.is_string(kind) or pa.types.is_binary(kind) or pa.types.is_large_string(kind)
            or pa.types.is_large_binary(kind))


def _parquet_blocks(parts: Parts) -> Iterator[pa.Table]:
    """Row groups checked from the footer, then batches of PARQUET_BATCH_ROWS with text read as dictionaries:
    what a batch decodes to is counted before any string is expanded."""
    url = redact(parts.url)
    try:
        schema = pq.read_schema(parts.local)
        text = [f.name for f in schema if _is_text(f.type.value_type if pa.types.is_dictionary(f.type) else f.type)]
        # each distinct string once; pages streamed (a row group is not read whole first)
        file = pq.ParquetFile(parts.local, read_dictionary=text, pre_buffer=False, buffer_size=1 << 20)
        meta = file.metadata
    except Exception as exc:  # noqa: BLE001 - pyarrow's many error types: one message
        raise MetadataError(f"{url}: not a readable Parquet file ({exc})") from exc
    with file:
        _check_columns(max(meta.num_columns, len(schema.names)), parts.url, "has")
        for g in range(meta.num_row_groups):
            if (size := meta.row_group(g).total_byte_size) > MAX_ROW_GROUP_BYTES:
                raise MetadataError(f"{url}: row group {g} holds {size} bytes uncompressed; the limit is "
                                    f"{MAX_ROW_GROUP_BYTES} (MAX_ROW_GROUP_BYTES)")
        first = 0
        try:
            batches = file.iter_batches(batch_size=PARQUET_BATCH_ROWS, use_threads=False)
            for batch in batches:
                decoded = batch.nbytes
                for name in text:
                    column = batch.column(name)
                    coded = pa.types.is_dictionary(column.type)
                    lengths = pc.binary_length(column.dictionary if coded else column)
                    longest = pc.max(lengths).as_py() or 0
                    if longest > MAX_CELL_CHARS:
                        raise MetadataError(f"{url}: column {name!r} has a value of {longest} bytes; the limit is "
                                            f"{MAX_CELL_CHARS} (MAX_CELL_CHARS)")
                    if coded:  # what the repeated strings cost once each row has its own
                        decoded += pc.sum(pc.take(lengths, column.indices)).as_py() or 0
                if decoded > MAX_BLOCK_BYTES:
                    raise MetadataError(f"{url}: rows {first + 1}-{first + batch.num_rows}: {decoded} bytes decoded; "
                                        f"the limit is {MAX_BLOCK_BYTES} a block of rows (MAX_BLOCK_BYTES)")
                block = pa.Table.from_batches([batch])
                block = block.cast(pa.schema([pa.field(f.name, f.type.value_type) if pa.types.is_dictionary(f.type)
                                              else f for f in block.schema]))
                yield _checked(parts, block, first)
                first += block.num_rows
        except MetadataError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise MetadataError(f"{url}: not a readable Parquet file ({exc})") from exc
