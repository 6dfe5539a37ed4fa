"""A shard's commit marker as a record: checked before it changes any state, and its rows as a table."""

from __future__ import annotations

import pyarrow as pa

from imgest.state.rows import STATE_SCHEMA
from imgest.storage import records

# What each part of a commit marker's rows holds (tasks/ingest/writer.py writes them), and the types of the fields.
_OBJECT = {"item_id", "uri", "etag", "size", "mtime", "content_hash"}
_ROW_FIELDS = {"encoded": _OBJECT, "unchanged": _OBJECT, "revived": _OBJECT | {"shard"},
               "rejected": _OBJECT | {"reason", "transient"}}
_TYPES = {"item_id": str, "uri": str, "etag": (str, type(None)), "size": int, "mtime": (int, float, type(None)),
          "content_hash": (str, type(None)), "shard": str, "reason": str, "transient": bool}


def _row_ok(row: object, allowed: set[str]) -> bool:
    return isinstance(row, dict) and "item_id" in row and row.keys() <= allowed and \
        all(isinstance(value, _TYPES[name]) for name, value in row.items())


def check_marker(marker: object, shard: str, where: str) -> dict:
    """The marker, when it names its own shard and its rows are objects of ItemState's fields with a string item_id
    (a planted marker stops the run; nothing changes)."""
    if records.field(marker, "shard", str, where) != shard:
        raise records.RecordError(f"{where}: names shard {marker['shard'][:80]!r}, not its own")
    for name in ("run_id", "created"):
        records.field(marker, name, str, where)
    for part, allowed in _ROW_FIELDS.items():
        rows = marker.get(part, [])
        if not isinstance(rows, list) or not all(_row_ok(row, allowed) for row in rows):
            raise records.RecordError(f"{where}: {part} must be a list of rows with an item_id and only "
                                      f"{', '.join(sorted(allowed))}")
    return marker


def rows_table(rows: list[dict], **constants) -> pa.Table:
    """Checked marker rows (ItemState's object fields) and the fields every one of them shares, as STATE_SCHEMA."""
    columns = {f.name: constants.get(f.name) for f in STATE_SCHEMA}
    return pa.table({name: pa.array([row.get(name) for row in rows] if name in _OBJECT else [value] * len(rows),
                                    STATE_SCHEMA.field(name).type) for name, value in columns.items()},
                    schema=STATE_SCHEMA)
