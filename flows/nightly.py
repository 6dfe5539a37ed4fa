"""The nightly job: ingest what changed, then build fresh indexes; during a migration window, for both models."""

from __future__ import annotations

import os
import socket

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from imgest import encoders
from imgest.config import NightlyConfig
from imgest.defaults import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_DECODE_WORKERS,
    DEFAULT_DEVICE,
    DEFAULT_DISK,
    DEFAULT_DTYPE,
    DEFAULT_ENCODE_LIMIT,
    DEFAULT_INDEX_PARTS,
    DEFAULT_K,
    DEFAULT_KIND,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_DELETE_FRACTION,
    DEFAULT_MAX_PIXELS,
    DEFAULT_MEMORY,
    DEFAULT_RUNNER,
    DEFAULT_SHARD_SIZE,
    DEFAULT_TARGET_RECALL,
    DEFAULT_WORKERS,
)
from imgest.flows.build_index import build_index
from imgest.flows.duplicates import duplicates
from imgest.flows.ingest import ingest
from imgest.lock import StoreLock
from imgest.storage import open_location
from imgest.tasks.markdown import render_nightly
from imgest.tasks.migration import check_window_model, nightly_models
from imgest.tasks.retention import collect_retired
from imgest.tasks.run_names import run_name


@flow(name="nightly", flow_run_name=run_name("nightly", None), validate_parameters=True)
def nightly(catalogue: str, store: str, model: str | None = None, batch_size: str = DEFAULT_BATCH_SIZE,
            device: str = DEFAULT_DEVICE, shard_size: int = DEFAULT_SHARD_SIZE,
            decode_workers: int = DEFAULT_DECODE_WORKERS, max_pixels: int = DEFAULT_MAX_PIXELS,
            runner: str = DEFAULT_RUNNER, workers: int = DEFAULT_WORKERS, encode_limit: str = DEFAULT_ENCODE_LIMIT,
            max_bytes: int = DEFAULT_MAX_BYTES, max_delete_fraction: float = DEFAULT_MAX_DELETE_FRACTION,
            allow_mass_delete: bool = False, dtype: str = DEFAULT_DTYPE, kind: str = DEFAULT_KIND,
            memory: str = DEFAULT_MEMORY, target_recall: float = DEFAULT_TARGET_RECALL, k: int = DEFAULT_K,
            index_parts: int = DEFAULT_INDEX_PARTS, metadata: str | None = None, inventory: str | None = None,
            report_duplicates: bool = False, disk: str = DEFAULT_DISK) -> dict:
    cfg = NightlyConfig(catalogue=catalogue, store=store, model=model, batch_size=batch_size, device=device,
                        shard_size=shard_size, decode_workers=decode_workers, max_pixels=max_pixels, runner=runner,
                        workers=workers, encode_limit=encode_limit, max_bytes=max_bytes,
                        max_delete_fraction=max_delete_fraction, allow_mass_delete=allow_mass_delete, dtype=dtype,
                        kind=kind, memory=memory, target_recall=target_recall, k=k, index_parts=index_parts,
                        metadata=metadata, inventory=inventory, report_duplicates=report_duplicates, disk=disk)
    store_loc = open_location(cfg.store)
    runs, bases, ingested = [], [], set()
    models, left_out = nightly_models(store_loc, cfg.model)
    for name, expected_slug in models:
        base = encoders.resolve(name).base
        if base is not None and base.slug not in ingested:
            # A head: its base model first, so new images are decoded and encoded once, into the base's
            # namespace, and the head derives every row from there. The base stays current for retraining
            # the head and for comparing against it; it gets no index of its own unless an alias is on it.
            base_summary = ingest(**cfg.ingest(base.name).to_dict())
            ingested.add(base_summary["slug"])
            bases.append(base_summary)
        summary = ingest(**cfg.ingest(name).to_dict())
        check_window_model(expected_slug, summary)
        index = build_index(**cfg.index(summary["slug"]).to_dict())
        ingested.add(summary["slug"])
        runs.append({"ingest": summary, "index": index})
    # models retired by a finished migration window go once their retention has passed and no alias needs them
    with StoreLock(store_loc, owner=f"nightly-retire@{socket.gethostname()}:{os.getpid()}") as lock:
        retired = collect_retired(store_loc, lock.fence)
    found = None
    if cfg.report_duplicates and runs:  # the serving model's duplicate groups, new ones since the last report
        found = duplicates(store=cfg.store, alias="serving")
        found.pop("groups")
    base_rows = [{"ingest": b, "index": {"built": False, "reason": "base of a head"}} for b in bases]
    create_markdown_artifact(render_nightly(base_rows + runs, retired, left_out, found), key="nightly-summary",
                             description=f"nightly {store_loc.url}")
    return {**(runs[0] if runs else {}), "models": runs, "bases": bases, "retired": retired, "left_out": left_out,
            "duplicates": found}
