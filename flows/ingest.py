"""The nightly ingest flow: list -> plan shards -> encode (one task per shard) -> commit -> artifact."""

from __future__ import annotations

from prefect import get_run_logger, tags
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.utilities.annotations import quote

from imgest import encoders
from imgest.config import IngestConfig
from imgest.config.flow_params import configured_flow
from imgest.images import decoders
from imgest.images.listing import check_apart
from imgest.memory import give_back
from imgest.progress import report
from imgest.reports.ingest import progress_line, render_summary
from imgest.reports.run_names import run_name
from imgest.runners import SHARDS_AHEAD, shard_runner, submit_in_order
from imgest.state import pixels
from imgest.state.committed import new_run_id
from imgest.state.lock import StoreLock, run_owner
from imgest.state.models import default_model
from imgest.storage import one_line, open_location
from imgest.tasks.ingest.commit import new_summary
from imgest.tasks.ingest.decode_workers import end_kept
from imgest.tasks.ingest.encode import ShardFailedError
from imgest.tasks.ingest.handoff import SharedMemoryError
from imgest.tasks.ingest.job import ShardJob
from imgest.tasks.ingest.steps import (
    attach_base_task,
    choose_encoding_task,
    commit_run_task,
    encode_shard_task,
    kept_pixels_task,
    list_catalogue_task,
    plan_ingest_task,
    prepare_state_task,
    read_inventory_task,
    store_metadata_task,
    text_listing_task,
)
from imgest.timing import Stopwatch


# Listing, planning and commit run in the flow's process; encode-shard tasks run on `runner`
# (imgest/runners.py): one at a time locally, or spread over a Dask cluster.
@configured_flow(name="ingest", flow_run_name=run_name("ingest"), task_runner=ThreadPoolTaskRunner(max_workers=1))
def ingest(config: IngestConfig) -> dict:
    store_loc = open_location(config.store)
    config = config.model_copy(update={"model": default_model(store_loc, config.model, field="name")})
    spec = encoders.resolve(config.model)
    device = encoders.resolve_device(config.device)
    encoders.runtimes.refuse_unusable(config.runtime, config.precision, device)  # before any listing or encoding
    encoders.refuse_unrecordable(spec, store_loc)  # a name the nightly would refuse to read back: refused now
    if "image" in spec.modalities:  # the model's recorded JPEG decoder must run here, or the run say how to go on
        record = decoders.check(store_loc, spec.slug, config.decoder, config.force_decoder, device)
        if spec.base is None and decoders.NVJPEG in (config.decoder, record and record.decoder) \
                and (config.keep_pixels or (config.keep_pixels is None and pixels.read_setting(store_loc, spec.slug))):
            raise decoders.DecoderError("keep_pixels: copies are made from a CPU decode, and this run decodes JPEGs "
                                        "with nvjpeg; keep pixels off (--keep-pixels 0) on GPU nodes")
    catalogue_loc = open_location(config.catalogue, must_exist=True, what="catalogue", follow_links=True)
    check_apart(catalogue_loc, store_loc)
    catalogue_url = catalogue_loc.url
    with tags(f"model:{spec.slug}"), StoreLock(store_loc, owner=run_owner("ingest")) as lock:
        state, orphans = prepare_state_task(store_loc.url, spec.describe(), catalogue_loc.url)
        run_id = new_run_id(state.seq + 1)
        summary = new_summary(spec, run_id, catalogue_url, store_loc.url, config.to_dict())
        if config.device == "auto" and device == "cpu" and (note := encoders.unusable_gpu()):
            summary.device_note = note
            get_run_logger().warning(note)
        listing = read_inventory_task(config.inventory, catalogue_url) if config.inventory else \
            list_catalogue_task(catalogue_url)
        if config.metadata:
            summary.metadata = store_metadata_task(store_loc.url, config.metadata, quote(listing)).to_dict()
        metadata_seq = None
        if "image" not in spec.modalities:  # a caption model: the listed images' metadata text is what it reads
            listing, summary.texts, metadata_seq = text_listing_task(store_loc.url, quote(listing), spec)
        # quote(): hand large values to tasks as they are; Prefect would otherwise walk every item in them
        # stops here, before any write, when the run would tombstone more than config.delete_limit of the live items
        plan = plan_ingest_task(store_loc.url, quote(listing), quote(state), run_id, config.shard_size,
                                config.max_bytes, config.delete_limit)
        if spec.base is not None and plan.shards:  # a head: derive from current base embeddings, decode the rest
            plan = attach_base_task(store_loc.url, spec.base.slug, quote(plan))
        batch, source, chosen = (0, "nothing to encode", None)
        if metadata_seq is not None and plan.shards:
            batch, source = (config.fixed_batch_size or 64, "fixed" if config.fixed_batch_size else "text model: 64")
        elif plan.any_to_decode():
            chosen = choose_encoding_task(store_loc.url, spec, device, config.runtime, config.precision,
                                          config.fixed_batch_size, catalogue_url, quote(plan.decode_sample()),
                                          config.max_pixels, run_id, config.decoder, config.force_decoder,
                                          first=state.seq == 0 and not state.pending, fence=lock.fence)
            batch, source = chosen.batch_size, chosen.source
        elif plan.shards:
            batch, source = (1, "every item derived from stored base embeddings")
        kept_report = None
        if "image" in spec.modalities and spec.base is None:  # a head reads its base's vectors, never pixels
            plan, kept_report = kept_pixels_task(store_loc.url, spec, device, chosen, quote(plan),
                                                 config.keep_pixels, run_id, config.max_pixels)
            if chosen is not None and kept_report.decode_seconds:  # mostly copies: decoding costs less
                chosen.decode_seconds = kept_report.decode_seconds
        results = []
        if plan.shards:
            progress = create_progress_artifact(0.0, key="ingest-progress",
                                                description=f"{len(plan.shards)} shard(s) to encode")
            report(spec.slug, 0, plan.to_read)  # a terminal's progress bar, when the CLI runs this flow
            counts = plan.counts()
            with shard_runner(config.runner, config.workers) as shard_tasks:
                encoding = Stopwatch()  # after a local cluster has started
                job = ShardJob.of(chosen, spec=spec, device=device, catalogue_url=catalogue_url,
                                  store_url=store_loc.url, batch_size=batch, decode_workers=config.decode_workers,
                                  max_pixels=config.max_pixels, encode_limit=config.encode_limit, fence=lock.fence,
                                  dtype=config.dtype, metadata_seq=metadata_seq,
                                  keep_side=kept_report.side if kept_report else 0,
                                  kept_source=kept_report.source if kept_report else None)
                running = submit_in_order(shard_tasks, encode_shard_task, plan.shards, {"job": job},
                                          ahead=SHARDS_AHEAD * max(config.workers, 1))
                for shard, future in running:  # in order: progress moves as shards commit
                    try:
                        results.append(future.result())
                    except SharedMemoryError:  # the host's to change, before the shard read anything: as it is
                        raise
                    except Exception as exc:
                        raise ShardFailedError(f"shard {shard.name} ({len(shard.items)} objects) failed after "
                                               f"retries: {one_line(exc)}") from exc
                    update_progress_artifact(progress, 100.0 * len(results) / len(plan.shards),
                                             description=progress_line(results, plan))
                    report(spec.slug, int(counts[:len(results)].sum()), plan.to_read)
                summary.encode_wall_seconds = encoding.seconds
            end_kept()  # the decode processes the last shard left: no shard of this run will want them
        summary.batch_size, summary.batch_size_source, summary.device = batch, source, device
        summary.record_encoding(chosen, results)
        summary.record_kept(kept_report, results)
        summary.removed_orphans = orphans
        summary = commit_run_task(store_loc.url, quote(state), quote(plan), quote(results), summary, lock.fence)
        state.close()  # the index build after this run loads the state afresh
        give_back()
    create_markdown_artifact(render_summary(summary), key="ingest-summary",
                             description=f"imgest ingest {summary.run_id} ({spec.model_id})")
    return summary.to_dict()
