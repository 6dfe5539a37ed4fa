"""The nightly ingest flow: list -> plan shards -> encode (one task per shard) -> commit -> artifact."""

from __future__ import annotations

import os
import socket

from prefect import flow, tags, unmapped
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.utilities.annotations import quote

from imgest import encoders
from imgest.config import IngestConfig
from imgest.defaults import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_DECODE_WORKERS,
    DEFAULT_DEVICE,
    DEFAULT_DTYPE,
    DEFAULT_ENCODE_LIMIT,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_DELETE_FRACTION,
    DEFAULT_MAX_PIXELS,
    DEFAULT_MODEL,
    DEFAULT_RUNNER,
    DEFAULT_SHARD_SIZE,
    DEFAULT_WORKERS,
)
from imgest.lock import StoreLock
from imgest.progress import report
from imgest.storage import one_line, open_location
from imgest.tasks.commit import new_summary
from imgest.tasks.encode import ShardFailedError
from imgest.tasks.ingest_tasks import (
    attach_base_task,
    choose_batch_size_task,
    commit_run_task,
    encode_shard_task,
    list_catalogue_fanned,
    plan_ingest_task,
    prepare_state_task,
    read_inventory_task,
    store_metadata_task,
    text_listing_task,
)
from imgest.tasks.listing import check_apart
from imgest.tasks.markdown import progress_line, render_summary
from imgest.tasks.run_names import run_name
from imgest.tasks.runners import shard_runner
from imgest.tasks.state import new_run_id
from imgest.timing import Stopwatch


# Listing, planning and commit run in the flow's process; encode-shard tasks run on `runner`
# (tasks/runners.py): one at a time locally, or spread over a Dask cluster.
@flow(name="ingest", flow_run_name=run_name("ingest"), task_runner=ThreadPoolTaskRunner(max_workers=1),
      validate_parameters=True)
def ingest(catalogue: str, store: str, model: str = DEFAULT_MODEL, batch_size: str = DEFAULT_BATCH_SIZE,
           device: str = DEFAULT_DEVICE, shard_size: int = DEFAULT_SHARD_SIZE,
           decode_workers: int = DEFAULT_DECODE_WORKERS, max_pixels: int = DEFAULT_MAX_PIXELS,
           runner: str = DEFAULT_RUNNER, workers: int = DEFAULT_WORKERS,
           encode_limit: str = DEFAULT_ENCODE_LIMIT, max_bytes: int = DEFAULT_MAX_BYTES,
           max_delete_fraction: float = DEFAULT_MAX_DELETE_FRACTION, allow_mass_delete: bool = False,
           dtype: str = DEFAULT_DTYPE, metadata: str | None = None, inventory: str | None = None) -> dict:
    cfg = IngestConfig(catalogue=catalogue, store=store, model=model, batch_size=str(batch_size), device=device,
                       shard_size=shard_size, decode_workers=decode_workers, max_pixels=max_pixels, runner=runner,
                       workers=workers, encode_limit=encode_limit, max_bytes=max_bytes,
                       max_delete_fraction=max_delete_fraction, allow_mass_delete=allow_mass_delete, dtype=dtype,
                       metadata=metadata, inventory=inventory)
    spec = encoders.resolve(cfg.model)
    device = encoders.resolve_device(cfg.device)
    store_loc = open_location(cfg.store)
    catalogue_loc = open_location(cfg.catalogue, must_exist=True, what="catalogue", follow_links=True)
    check_apart(catalogue_loc, store_loc)
    catalogue_url = catalogue_loc.url
    with tags(f"model:{spec.slug}"), StoreLock(store_loc, owner=f"ingest@{socket.gethostname()}:{os.getpid()}") as lock:
        state, orphans = prepare_state_task(store_loc.url, spec.describe(), catalogue_loc.url)
        run_id = new_run_id(state.seq + 1)
        summary = new_summary(spec, run_id, catalogue_url, store_loc.url, cfg.to_dict())
        listing = read_inventory_task(cfg.inventory, catalogue_url) if cfg.inventory else \
            list_catalogue_fanned(catalogue_url)
        if cfg.metadata:
            summary.metadata = store_metadata_task(store_loc.url, cfg.metadata, quote(listing)).to_dict()
        metadata_seq = None
        if "image" not in spec.modalities:  # a caption model: the listed images' metadata text is what it reads
            listing, summary.texts, metadata_seq = text_listing_task(store_loc.url, quote(listing), spec)
        # quote(): hand large values to tasks as they are; Prefect would otherwise walk every item in them
        # stops here, before any write, when the run would tombstone more than cfg.delete_limit of the live items
        plan = plan_ingest_task(quote(listing), quote(state), run_id, cfg.shard_size, cfg.max_bytes, cfg.delete_limit)
        if spec.base is not None and plan.shards:  # a head: derive from current base embeddings, decode the rest
            plan = attach_base_task(store_loc.url, spec.base.slug, quote(plan))
        batch, source = (0, "nothing to encode")
        if metadata_seq is not None and plan.shards:
            batch, source = (cfg.fixed_batch_size or 64, "fixed" if cfg.fixed_batch_size else "text model: 64")
        elif any(not item.base_shard for shard in plan.shards for item in shard.items):
            batch, source = choose_batch_size_task(store_loc.url, spec, device, cfg.fixed_batch_size)
        elif plan.shards:
            batch, source = (1, "every item derived from stored base embeddings")
        results = []
        if plan.shards:
            progress = create_progress_artifact(0.0, key="ingest-progress",
                                                description=f"{len(plan.shards)} shard(s) to encode")
            report(spec.slug, 0, plan.to_read)  # a terminal's progress bar, when the CLI runs this flow
            with shard_runner(cfg.runner, cfg.workers) as shard_tasks:
                encoding = Stopwatch()  # after a local cluster has started
                futures = shard_tasks.map(encode_shard_task, {
                    "plan": plan.shards, "spec": unmapped(spec), "device": unmapped(device),
                    "catalogue_url": unmapped(catalogue_url), "store_url": unmapped(store_loc.url),
                    "batch_size": unmapped(batch), "decode_workers": unmapped(cfg.decode_workers),
                    "max_pixels": unmapped(cfg.max_pixels), "encode_limit": unmapped(cfg.encode_limit),
                    "fence": unmapped(lock.fence), "dtype": unmapped(cfg.dtype),
                    "metadata_seq": unmapped(metadata_seq)})
                for shard, future in zip(plan.shards, futures):  # in order: progress moves as shards commit
                    try:
                        results.append(future.result())
                    except Exception as exc:
                        raise ShardFailedError(f"shard {shard.name} ({len(shard.items)} objects) failed after "
                                               f"retries: {one_line(exc)}") from exc
                    update_progress_artifact(progress, 100.0 * len(results) / len(plan.shards),
                                             description=progress_line(results, plan))
                    report(spec.slug, sum(len(s.items) for s in plan.shards[:len(results)]), plan.to_read)
                summary.encode_wall_seconds = encoding.seconds
        summary.batch_size, summary.batch_size_source, summary.device = batch, source, device
        summary.removed_orphans = orphans
        summary = commit_run_task(store_loc.url, quote(state), quote(plan), quote(results), summary, lock.fence)
    create_markdown_artifact(render_summary(summary), key="ingest-summary",
                             description=f"imgest ingest {summary.run_id} ({spec.model_id})")
    return summary.to_dict()
