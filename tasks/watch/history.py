"""The nightly history: one row of figures per model per night, kept in the store (it outlives a Prefect server
and Prefect's event retention), read back for trends and for the medians that mark an unusual night.

A row is written once, create-only, under `history/nightly/model=<slug>/<finished>-<run_id>.json`: two
nightlies never share a name, a retried write of the same night changes nothing, and readers list the
folder and take the newest names.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter

from imgest.state.layout import MODEL, embeddings_prefix
from imgest.state.layout import NIGHTLY_HISTORY as HISTORY
from imgest.state.layout import nightly_history_prefix as history_prefix
from imgest.storage import Location, records

ROW_VERSION = 1


def reason_of(message: str) -> str:
    """A rejection's kind, for counting by reason: its text up to the first ':' or '(' ('not an image',
    'too large', 'decode failed'), digits and quotes taken out so that sizes and names do not split it."""
    head = re.split(r"[:(]", message, maxsplit=1)[0]
    return re.sub(r"\s+", " ", re.sub(r"[\d'\"`]+", "", head)).strip().lower()[:60] or "other"


def night_row(ingest: dict, index: dict, store: Location, drift: dict | None = None) -> dict:
    """The figures of one model's night: what the catalogue did, what ingest did with it, what the index is."""
    card = index.get("card") if index.get("built") else None
    lineage = (card or {}).get("lineage") or {}
    recall = (card or {}).get("recall") or {}
    search = (card or {}).get("search") or {}
    touched = ingest["new"] + ingest["changed"]
    return {
        "row_version": ROW_VERSION,
        "date": ingest["finished"][:10],
        "finished": ingest["finished"],
        "run_id": ingest["run_id"],
        "model_id": ingest["model_id"],
        "slug": ingest["slug"],
        "listed": ingest["listed"],
        "new": ingest["new"],
        "changed": ingest["changed"],
        "deleted": ingest["deleted"],
        "revived": ingest.get("revived", 0),
        "encoded": ingest["encoded"],
        "rejected": ingest["rejected"],
        "rejected_share": round(ingest["rejected"] / touched, 4) if touched else 0.0,
        "rejected_by_reason": dict(Counter(reason_of(r) for _, r in ingest.get("rejected_items", []))),
        "images_per_second": ingest["images_per_second"],
        "seconds": {"ingest": ingest["seconds"], "encode_wall": ingest.get("encode_wall_seconds", 0.0),
                    "index": ((card or {}).get("times") or {}).get("total_seconds", 0.0)},
        "index": None if card is None else {
            "factory": card["factory"], "version": card["version"], "reused": bool(index.get("reused")),
            "method": "reused" if index.get("reused") else lineage.get("method", "build"),
            "why": lineage.get("why"), "vectors": card["n"]},
        "recall": None if not recall else {
            "k": recall["k"], "value": recall[f"recall@{recall['k']}"], "target": recall["target"],
            "met": recall["met"], "param": search.get("param"), "param_value": search.get("value")},
        "shard_bytes": sum(obj.size for obj in store.walk(embeddings_prefix(ingest["slug"]))),
        "drift": drift,
    }


def record_night(store: Location, row: dict) -> str:
    """Write the row once; the key it is (or already was) at."""
    stamp = re.sub(r"[^0-9T]", "", row["finished"])[:15]
    key = f"{history_prefix(row['slug'])}/{stamp}-{re.sub(r'[^A-Za-z0-9-]', '', row['run_id'])}.json"
    store.create_exclusive(key, json.dumps(row, sort_keys=True).encode())
    return key


def read_history(store: Location, slug: str | None = None, nights: int = 30) -> list[dict]:
    """The newest `nights` rows of one model (every model's when None), oldest first. A row that does not
    read as a history row is skipped with its name in a warning, never trusted."""
    slugs = [slug] if slug else [f.removeprefix(MODEL) for f in store.folders(HISTORY) if f.startswith(MODEL)]
    rows = []
    for one in slugs:
        try:
            prefix = history_prefix(one)
        except records.RecordError as exc:  # a folder no nightly made: nothing under it is read
            logging.getLogger("imgest").warning("history: skipped %s: %s", one, exc)
            continue
        kept = 0
        for name in reversed([n for n in store.list_names(prefix) if n.endswith(".json")]):  # newest first
            if kept == nights:
                break
            try:
                row = store.read_json(f"{prefix}/{name}")
                if not isinstance(row, dict) or row.get("slug") != one or not isinstance(row.get("finished"), str):
                    raise ValueError("not a history row of this model")
            except (ValueError, OSError) as exc:
                logging.getLogger("imgest").warning("history: skipped %s/%s: %s", prefix, name, exc)
                continue
            rows.append(row)
            kept += 1
    return sorted(rows, key=lambda r: (r["slug"], r["finished"]))
