"""A head's label file (CSV with the header `item_id,label`, or JSONL with those keys) read as columns; a malformed
one refused in one line naming its line or row."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from imgest.errors import UserError
from imgest.storage import Location, redact
from imgest.storage.cache import local_copy

LABELS_SCHEMA = pa.schema([("item_id", pa.string()), ("label", pa.string())])
STAGED_SCHEMA = pa.schema([("item_id", pa.string()), ("label", pa.string()), ("row", pa.int64())])
LABEL_BLOCK_BYTES = 4 << 20  # a label file is parsed this much at a time (a CSV record, a JSONL line must fit)


class HeadError(UserError, ValueError):
    """Labels, split or parameters cannot train a head; says what is wrong and what is allowed."""


def is_jsonl(name: str) -> bool:
    return name.endswith((".jsonl", ".json"))


@dataclass
class StagedLabels:
    """A label file's rows as Parquet on local disk (item_id, label, row: the file's order), for DuckDB to join."""

    path: str
    rows: int
    sha256: str
    ordered: bool  # item_ids strictly increasing through the file: each once, no pass to find an item's last row

    def relation(self) -> str:
        """SQL for the labelled items, each once with the label of its last row."""
        from imgest.state.rows import sql_string

        source = f"read_parquet({sql_string(self.path)})"
        if self.ordered:
            return f"(SELECT item_id, label FROM {source})"
        return f"(SELECT item_id, arg_max(label, \"row\") AS label FROM {source} GROUP BY item_id)"


def stage_labels(url: str, folder: str) -> StagedLabels:
    """Read the label file at `url` (CSV with the header `item_id,label`, or JSONL with those keys; any fsspec URL,
    a remote one copied to `folder` first) LABEL_BLOCK_BYTES at a time with Arrow's streaming readers, check each
    block, and write the rows to Parquet in `folder`: nothing in proportion to the file is held. A file those readers
    refuse is read again row by row, which names the line (or reads what they were too strict for)."""
    os.makedirs(folder, exist_ok=True)
    loc = Location(url)
    try:
        if not loc.fs.isfile(loc.path("")):
            raise FileNotFoundError(url)
        local = local_copy(loc, "", os.path.join(folder, "download"), checksum="",
                           suffix=posixpath.splitext(url.split("?", 1)[0].lower())[1][:9])
    except (FileNotFoundError, IsADirectoryError) as exc:
        raise HeadError(f"{redact(url)} does not exist (or is not a file)") from exc
    with open(local, "rb") as fh:
        sha256 = hashlib.file_digest(fh, "sha256").hexdigest()
    path = os.path.join(folder, "labels.parquet")
    staged = StagedLabels(path, 0, sha256, True)
    last: str | None = None
    try:
        with pq.ParquetWriter(path, STAGED_SCHEMA, compression="zstd") as writer:
            for block in _label_blocks(local, url):
                _check_block(block, staged.rows, url)
                ids = block["item_id"]
                if staged.ordered and len(ids):
                    rising = len(ids) < 2 or pc.all(pc.less(ids.slice(0, len(ids) - 1), ids.slice(1))).as_py()
                    staged.ordered = bool(rising) and (last is None or ids[0].as_py() > last)
                    last = ids[-1].as_py()
                writer.write_table(block.append_column(
                    "row", pa.array(np.arange(staged.rows, staged.rows + len(block)), pa.int64())))
                staged.rows += len(block)
    except (pa.ArrowException, KeyError):
        with open(local, "rb") as fh:
            table = _from_rows(read_labels(fh.read(), url))
        pq.write_table(table.append_column("row", pa.array(np.arange(len(table)), pa.int64())), path)
        staged.rows, staged.ordered = len(table), True
    finally:
        pa.default_memory_pool().release_unused()  # the blocks' memory back before DuckDB takes its share
    return staged


def _label_blocks(local: str, name: str) -> Iterator[pa.Table]:
    import pyarrow.csv
    import pyarrow.json

    if is_jsonl(name):
        reader = pyarrow.json.open_json(local, read_options=pyarrow.json.ReadOptions(
            use_threads=False, block_size=LABEL_BLOCK_BYTES), parse_options=pyarrow.json.ParseOptions(
            explicit_schema=LABELS_SCHEMA, unexpected_field_behavior="ignore"))
    else:
        reader = pyarrow.csv.open_csv(local, read_options=pyarrow.csv.ReadOptions(
            use_threads=False, block_size=LABEL_BLOCK_BYTES), convert_options=pyarrow.csv.ConvertOptions(
            column_types=LABELS_SCHEMA, include_columns=LABELS_SCHEMA.names, strings_can_be_null=False))
    for batch in reader:
        yield pa.Table.from_batches([batch]).select(LABELS_SCHEMA.names).cast(LABELS_SCHEMA)


def _check_block(table: pa.Table, first: int, name: str) -> None:
    bad = pc.or_kleene(_blank(table["item_id"]), _blank(table["label"]))
    if pc.any(bad).as_py():
        row = first + int(np.flatnonzero(bad.to_numpy(zero_copy_only=False))[0]) + 1
        raise HeadError(f"{name} row {row}: item_id and label are both required")


def read_label_table(data: bytes, name: str) -> pa.Table:
    """(item_id, label) of every row of the file, each item once (its last row wins, as a later line corrects an
    earlier one), parsed by Arrow's CSV or JSON reader: no object per row. A file those readers refuse (a line
    that is not JSON, a short CSV row, a header without the columns, a number where an id goes) is read again
    row by row, which names the line, or reads what the columnar readers were too strict for."""
    import pyarrow.csv
    import pyarrow.json

    try:
        if is_jsonl(name):
            table = pyarrow.json.read_json(io.BytesIO(data), parse_options=pyarrow.json.ParseOptions(
                explicit_schema=LABELS_SCHEMA, unexpected_field_behavior="ignore"))
        else:
            table = pyarrow.csv.read_csv(io.BytesIO(data), convert_options=pyarrow.csv.ConvertOptions(
                column_types=LABELS_SCHEMA, include_columns=LABELS_SCHEMA.names, strings_can_be_null=False))
    except (pa.ArrowException, KeyError):
        return _from_rows(read_labels(data, name))
    table = table.select(LABELS_SCHEMA.names).cast(LABELS_SCHEMA)
    bad = pc.or_kleene(_blank(table["item_id"]), _blank(table["label"]))
    if pc.any(bad).as_py():
        row = int(np.flatnonzero(bad.to_numpy(zero_copy_only=False))[0]) + 1
        raise HeadError(f"{name} row {row}: item_id and label are both required")
    return last_per_item(table)


def _blank(column: pa.ChunkedArray) -> pa.ChunkedArray:
    return pc.fill_null(pc.equal(column, ""), True)


def last_per_item(table: pa.Table) -> pa.Table:
    """Each item_id once, with the label of its last row, in item_id order (a file already in strictly increasing
    item_id order, as an export writes one, is that: checked by comparing neighbours, no hash table)."""
    ids = table["item_id"].combine_chunks()
    if len(ids) < 2 or pc.all(pc.greater(ids.slice(1), ids.slice(0, len(ids) - 1))).as_py():
        return table
    numbered = table.append_column("line", pa.array(np.arange(len(table)), pa.int64()))
    last = numbered.group_by("item_id").aggregate([("line", "max")])
    rows = pc.sort_indices(last, sort_keys=[("item_id", "ascending")])
    return table.take(last["line_max"].take(rows)).select(LABELS_SCHEMA.names)


def _from_rows(labels: dict[str, str]) -> pa.Table:
    return pa.table({"item_id": list(labels), "label": list(labels.values())}, schema=LABELS_SCHEMA).sort_by("item_id")


def read_labels(data: bytes, name: str) -> dict[str, str]:
    """The rows of a label file as a dict, read row by row: where the columnar read refuses a file, this says
    which line is wrong (a few rows, or the error path only)."""
    text = data.decode("utf-8-sig")
    rows: list[dict] = []
    if is_jsonl(name):
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise HeadError(f"{name} line {n}: not JSON ({exc.msg})") from None
    else:
        reader = csv.DictReader(io.StringIO(text))
        if not reader.fieldnames or not {"item_id", "label"} <= set(reader.fieldnames):
            raise HeadError(f"{name}: a labels CSV needs the header `item_id,label`; got {reader.fieldnames}")
        rows = list(reader)
    labels = {}
    for n, row in enumerate(rows, 1):
        if not row.get("item_id") or row.get("label") in (None, ""):
            raise HeadError(f"{name} row {n}: item_id and label are both required")
        labels[str(row["item_id"])] = str(row["label"])
    return labels
