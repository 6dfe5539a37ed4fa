"""The nightly job: ingest what changed, then build fresh indexes; during a migration window, for both models."""

from __future__ import annotations

import os
import socket

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.build_index import build_index
from flows.ingest import ingest
from flows.naming import run_name
from imgest import encoders
from imgest.encoders import DEFAULT_MODEL
from imgest.lock import StoreLock
from imgest.storage import open_location
from tasks.decode import DEFAULT_MAX_PIXELS
from tasks.migration import check_window_model, collect_retired, nightly_models


@flow(name="nightly", flow_run_name=run_name("nightly", None), validate_parameters=True)
def nightly(catalogue: str, store: str, model: str = DEFAULT_MODEL, batch_size: str = "auto", device: str = "auto",
            shard_size: int = 2000, decode_workers: int = 2, max_pixels: int = DEFAULT_MAX_PIXELS,
            kind: str = "auto", memory: str = "4G", target_recall: float = 0.95, k: int = 10, runner: str = "local",
            workers: int = 0, index_parts: int = 1) -> dict:
    store_loc = open_location(store)
    runs, bases, ingested = [], [], set()
    for name, expected_slug in nightly_models(store_loc, model):
        base = encoders.resolve(name).base
        if base is not None and base.slug not in ingested:
            # A head: its base model first, so new images are decoded and encoded once, into the base's
            # namespace, and the head derives every row from there. The base stays current for retraining
            # the head and for comparing against it; it gets no index of its own unless an alias is on it.
            base_summary = ingest(catalogue, store, base.name, batch_size, device, shard_size, decode_workers,
                                  max_pixels, runner=runner, workers=workers)
            ingested.add(base_summary["slug"])
            bases.append(base_summary)
        summary = ingest(catalogue, store, name, batch_size, device, shard_size, decode_workers, max_pixels,
                         runner=runner, workers=workers)
        check_window_model(expected_slug, summary)
        # alias "auto": each rebuilt index moves the aliases already on its model (serving, shadow, previous)
        index = build_index(store, summary["slug"], kind, memory, target_recall, k, alias="auto", parts=index_parts,
                            runner=runner, workers=workers)
        ingested.add(summary["slug"])
        runs.append({"ingest": summary, "index": index})
    # models retired by a finished migration window go once their retention has passed and no alias needs them
    with StoreLock(store_loc, owner=f"nightly-retire@{socket.gethostname()}:{os.getpid()}"):
        retired = collect_retired(store_loc)
    base_rows = [{"ingest": b, "index": {"built": False, "reason": "base of a head"}} for b in bases]
    create_markdown_artifact(render_nightly(base_rows + runs, retired), key="nightly-summary",
                             description=f"nightly {store_loc.url}")
    return {**runs[0], "models": runs, "bases": bases, "retired": retired}


def render_nightly(runs: list[dict], retired: list) -> str:
    lines = ["# imgest nightly", "", "| model | listed | encoded | rejected | deleted | images/s | index | recall@k "
             "| aliases |", "|---|---:|---:|---:|---:|---:|---|---:|---|"]
    for run in runs:
        s, index = run["ingest"], run["index"]
        if index.get("built"):
            card = index["card"]
            built = f"v{card['version']:04d} `{card['factory']}`"
            rec = card["recall"]
            recall = f"{rec['recall@' + str(rec['k'])]:.3f}"
        else:
            built, recall = index.get("reason", "not built"), "-"
        lines.append(f"| `{s['model_id']}` | {s['listed']} | {s['encoded']} | {s['rejected']} | {s['deleted']} | "
                     f"{s['images_per_second']} | {built} | {recall} | {', '.join(index.get('aliases', [])) or '-'} |")
    if retired:
        lines += ["", f"Retired: {', '.join(map(str, retired))}"]
    return "\n".join(lines)
