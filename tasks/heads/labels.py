"""A head's label file (CSV with the header `item_id,label`, or JSONL with those keys) read as columns; a malformed
one refused in one line naming its line or row."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from imgest.errors import UserError

LABELS_SCHEMA = pa.schema([("item_id", pa.string()), ("label", pa.string())])


class HeadError(UserError, ValueError):
    """Labels, split or parameters cannot train a head; says what is wrong and what is allowed."""


def is_jsonl(name: str) -> bool:
    return name.endswith((".jsonl", ".json"))


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
