"""Shadow traffic records of a migration window: live queries also run on the candidate, as the service saw them.

  migration/shadow/<window id>/<time>-<token>.parquet   create-only parts, one per flush of a service

Each row is one live query answered by `serving` and run again, off the request path, on `shadow` (the window's
candidate): overlap@k of the two result lists and both latencies, never the query itself. `imgest migrate status`
summarises them and `migrate promote --min-shadow-agreement` gates on the mean overlap. Parts are records like
any other: a part with another schema, too many rows or values out of range is skipped with a warning.
"""

from __future__ import annotations

import logging
import math
import re
import secrets
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from imgest.state import layout
from imgest.storage import Location, RecordError

SCHEMA = pa.schema([
    ("at", pa.string()),  # ISO time the query was answered
    ("kind", pa.string()),  # image | text | item
    ("k", pa.int32()),
    ("overlap", pa.float64()),  # |served top k ∩ shadow top k| / the longer list; null when shadow failed
    ("served_ms", pa.float64()),
    ("shadow_ms", pa.float64()),  # null when shadow failed
    ("serving", pa.string()),  # model=<slug> v<version> that answered
    ("shadow", pa.string()),
    ("error", pa.string()),  # why shadow could not answer (one line), else null
])
MAX_PART_ROWS = 100_000
MAX_PART_BYTES = 32 << 20
MIN_QUERIES = 30  # fewer recorded queries than this prove no agreement


def shadow_prefix(window_id: str) -> str:
    if not isinstance(window_id, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", window_id):
        raise RecordError(f"window id {str(window_id)[:120]!r} is not a window id (letters, digits, . _ -)")
    return layout.shadow_prefix(window_id)


def overlap(served: list[str], shadow: list[str]) -> float:
    """Share of the longer list both lists hold: 1.0 when they hold the same items (in any order), 0.0 when
    they share none; two empty lists agree."""
    longest = max(len(served), len(shadow))
    return len(set(served) & set(shadow)) / longest if longest else 1.0


def write_part(store: Location, window_id: str, rows: list[dict], made_by: str) -> str:
    """One create-only part (a unique name per flush, written whole); returns its key."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")
    key = f"{shadow_prefix(window_id)}/{stamp}-{secrets.token_hex(4)}.parquet"
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    store.write_table(key, table.replace_schema_metadata({"imgest.made_by": made_by, "imgest.window": window_id}))
    return key


def read_parts(store: Location, window_id: str) -> pa.Table:
    """Every valid row recorded for a window; a malformed part is skipped with a warning."""
    prefix, tables = shadow_prefix(window_id), []
    for name in store.list_names(prefix) if store.exists(prefix) else []:
        if not name.endswith(".parquet"):
            continue
        data = store.read_bytes(f"{prefix}/{name}", limit=MAX_PART_BYTES + 1)  # an unreachable store stops here
        try:
            tables.append(_parsed(data))
        except (RecordError, pa.ArrowException, ValueError) as exc:  # the part, not the store
            logging.getLogger("imgest").warning("%s/%s: skipped: %s", prefix, name, str(exc).splitlines()[0][:300])
    return pa.concat_tables(tables) if tables else SCHEMA.empty_table()


def _parsed(data: bytes) -> pa.Table:
    if len(data) > MAX_PART_BYTES:
        raise RecordError(f"larger than {MAX_PART_BYTES} bytes")
    part = pq.ParquetFile(pa.BufferReader(data))
    if part.metadata.num_rows > MAX_PART_ROWS:
        raise RecordError(f"{part.metadata.num_rows} rows, more than {MAX_PART_ROWS}")
    table = part.read()
    if set(table.column_names) != set(SCHEMA.names):
        raise RecordError(f"columns {sorted(table.column_names)} are not a shadow record's")
    table = table.select(SCHEMA.names).cast(SCHEMA)
    for column, low, high in (("overlap", 0.0, 1.0), ("served_ms", 0.0, math.inf), ("shadow_ms", 0.0, math.inf)):
        values = table.column(column).drop_null().to_numpy()
        if len(values) and not (np.isfinite(values).all() and values.min() >= low and values.max() <= high):
            raise RecordError(f"{column} holds values outside [{low}, {high}]")
    return table


def summary(store: Location, window_id: str) -> dict:
    """What shadow traffic says so far: queries, mean overlap@k, latency p50/p99 of each side, errors, and
    the index versions compared (rows per pair)."""
    table = read_parts(store, window_id)
    ok = table.filter(table.column("error").is_null())
    overlaps, served, shadow = (ok.column(c).to_numpy() for c in ("overlap", "served_ms", "shadow_ms"))
    pairs: dict[str, int] = {}
    for a, b in zip(table.column("serving").to_pylist(), table.column("shadow").to_pylist()):
        pairs[f"{a} | {b}"] = pairs.get(f"{a} | {b}", 0) + 1
    return {
        "queries": len(ok),
        "errors": len(table) - len(ok),
        "mean_overlap": round(float(overlaps.mean()), 6) if len(ok) else None,
        "k": sorted(set(ok.column("k").to_pylist())),
        "latency_ms": {side: _percentiles(values) for side, values in (("serving", served), ("shadow", shadow))},
        "compared": pairs,
        "first": min(table.column("at").to_pylist(), default=None),
        "last": max(table.column("at").to_pylist(), default=None),
    }


def _percentiles(values: np.ndarray) -> dict:
    if not len(values):
        return {"p50": None, "p99": None}
    return {"p50": round(float(np.percentile(values, 50)), 3), "p99": round(float(np.percentile(values, 99)), 3)}


def check_agreement(shadow: dict, minimum: float) -> str | None:
    """Refusal reason when shadow traffic does not show at least `minimum` mean overlap@k on enough queries."""
    if shadow["queries"] < MIN_QUERIES:
        return (f"shadow traffic recorded {shadow['queries']} queries, fewer than {MIN_QUERIES}: serve the window "
                "with `imgest api --shadow-share F` for longer, or promote without --min-shadow-agreement")
    if shadow["mean_overlap"] < minimum:
        return (f"shadow traffic agrees with serving at mean overlap@k {shadow['mean_overlap']:.4f} over "
                f"{shadow['queries']} queries, below the --min-shadow-agreement {minimum}")
    return None
