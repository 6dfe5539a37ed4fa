"""How much of the serving model's live catalogue a window's new model holds with the same content."""

from __future__ import annotations

import os

from imgest.state.committed import LIVE, load_state
from imgest.state.live import live_fingerprint
from imgest.state.rows import sql_string
from imgest.storage import Location

_LAST: dict[tuple, dict] = {}  # the last coverage measured in this process, by what it was measured on


def coverage(store: Location, window: dict) -> dict:
    """Share of the old model's live items that the new model holds with the same content. Measured once per
    pair of live sets in a process (a promote checks it, then its status shows it: at 10M items each join
    takes ~15 s); the live sets are named by their fingerprints, so a commit between measures again."""
    key = (store.url, live_fingerprint(store, window["from"]["slug"]), live_fingerprint(store, window["to"]["slug"]))
    if key not in _LAST:
        _LAST.clear()
        _LAST[key] = _measure(store, window)
    return dict(_LAST[key])


def _measure(store: Location, window: dict) -> dict:
    """The new model's live (item_id, content_hash) written to a file from its state's DuckDB, joined in the old
    state's (one database open at a time, memory capped, spilling): no row of either comes into memory."""
    new = load_state(store, window["to"]["slug"])
    try:
        pairs = os.path.join(new.base.folder, "live-pairs.parquet")
        with new.sql() as cur:
            cur.execute(f"""COPY (SELECT item_id, coalesce(content_hash, '') AS content_hash FROM state
                                  WHERE status = '{LIVE}') TO {sql_string(pairs)} (FORMAT parquet)""")
        new.close()  # its memory back before the old state's join; the file stays with its folder
        old = load_state(store, window["from"]["slug"])
        try:
            with old.sql() as cur:
                cur.execute(f"""CREATE TEMP VIEW covered AS SELECT s.item_id, EXISTS (
                                    SELECT 1 FROM read_parquet({sql_string(pairs)}) n WHERE n.item_id = s.item_id
                                    AND n.content_hash = coalesce(s.content_hash, '')) AS held
                                FROM state s WHERE s.status = '{LIVE}'""")
                live, covered = cur.execute("SELECT count(*), count(*) FILTER (held) FROM covered").fetchone()
                missing = [row[0] for row in cur.execute(  # a second join: only when something is missing
                    "SELECT item_id FROM covered WHERE NOT held ORDER BY item_id LIMIT 10").fetchall()] \
                    if covered < live else []
        finally:
            old.close()
    finally:
        new.close()
    return {"live": live, "covered": covered, "share": round(covered / live, 6) if live else 1.0,
            "missing_examples": missing}
