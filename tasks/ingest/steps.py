"""The ingest flow's tasks: thin Prefect wrappers over listing, state, planning, batch-size tuning, the
shard encoder (with its per-GPU concurrency slot) and the commit. The functions they wrap import no
Prefect, so the encode path runs (and is checked on a GPU machine) without it."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from imgest import encoders
from imgest.encoders import EncoderSpec, parity
from imgest.events import emit
from imgest.images import decoders
from imgest.images.listing import Listing, catalogue_parts, list_catalogue, merge_listings
from imgest.names import DEFAULT_MAX_PIXELS
from imgest.policy import COMMIT_TIMEOUT_S, IO_RETRIES, LIST_TIMEOUT_S, SHARD_RETRIES, io_retrying
from imgest.state import pixels
from imgest.state.catalogue_images import record_root
from imgest.state.committed import CatalogueState, load_state, prepare_state
from imgest.state.lock import Fence
from imgest.state.metadata import (
    MetadataReport,
    NoMetadataError,
    latest_seq,
    snapshot_key,
    store_metadata,
)
from imgest.storage import Location
from imgest.tasks.ingest import kept
from imgest.tasks.ingest.batch_size import Encoding, choose_encoding
from imgest.tasks.ingest.commit import RunSummary, commit_run
from imgest.tasks.ingest.decoder import choose_decoder, model_side
from imgest.tasks.ingest.encode import decode_cost, encode_shard
from imgest.tasks.ingest.encode_text import encode_text_shard, shard_texts, text_listing
from imgest.tasks.ingest.inventory import read_inventory
from imgest.tasks.ingest.job import ShardJob
from imgest.tasks.ingest.kept import KeptReport
from imgest.tasks.ingest.plan import MassDeleteError, Plan, ShardPlan, WorkItem, attach_base, plan_ingest
from imgest.tasks.ingest.writer import ShardResult


@task(name="choose-encoding", cache_policy=NO_CACHE)
def choose_encoding_task(store_url: str, spec: EncoderSpec, device: str, runtime: str, precision: str,
                         fixed_batch_size: int | None, catalogue_url: str, sample: tuple[WorkItem, ...] = (),
                         max_pixels: int = DEFAULT_MAX_PIXELS, run_id: str = "", decoder: str | None = None,
                         force_decoder: str | None = None, first: bool = True, fence: Fence | None = None) -> Encoding:
    """Runtime, precision and batch size for the run; its JPEG decode (the decoder and side the model's store
    records, or on its first run there the model's default, recorded; or `decoder` past the gate: all before any
    shard, tasks/ingest/decoder.py) and the decode's cost, measured on a sample of the images to read (the split
    of the cores follows both costs); what was asked for and could not run is one warning."""
    encoding = choose_encoding(store_url, spec, device, runtime, precision, fixed_batch_size)
    encoder = encoders.load(spec, device, encoding.runtime, encoding.precision)
    catalogue, store = Location(catalogue_url, follow_links=True), Location(store_url)
    choice = choose_decoder(store, spec.slug, run_id, decoder, force_decoder, first, device,
                            lambda name: model_side(encoder, name),
                            lambda recorded, asked, side: parity.decoder_parity(encoder, recorded, asked, side=side),
                            fence, legacy=decoders.legacy_side(encoder))
    # the chosen decoder's cost alone, what splits the cores (nvJPEG: the CPU's, Pillow for what the GPU does not
    # decode); a measurement, never a choice
    cost = decode_cost(catalogue, sample, encoder, max_pixels, side=choice.side,
                       names=(decoders.PILLOW if choice.decoder == decoders.NVJPEG else choice.decoder,)) \
        if sample else None
    encoding.decoder, encoding.decoder_source, encoding.decoder_gate = choice.decoder, choice.source, choice.gate
    encoding.decode_side, encoding.side_gate = choice.side, choice.side_gate
    if cost is not None:
        encoding.decode_seconds, encoding.decoders = cost.seconds, cost.measured
    logger = get_run_logger()
    if encoding.warning:
        logger.warning(encoding.warning)
    logger.info("encoding with %s %s at batch %d (%s); measured img/s%s: %s; not used: %s; JPEGs decoded by %s, %s "
                "(core-ms per image: %s)", encoding.runtime, encoding.precision, encoding.batch_size, encoding.source,
                f" at batch {encoding.measured_at}" if encoding.measured_at else "",
                encoding.measured or "nothing to compare", "; ".join(encoding.refused) or "none",
                decoders.Decode(encoding.decoder, encoding.decode_side or None).describe(), encoding.decoder_source,
                ", ".join(f"{k} {v * 1e3:.2f}" for k, v in encoding.decoders.items()) or "not measured")
    return encoding


@task(name="kept-pixels", cache_policy=NO_CACHE, **IO_RETRIES)
def kept_pixels_task(store_url: str, spec: EncoderSpec, device: str, chosen: Encoding | None, plan: Plan,
                     asked: int | None, run_id: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[Plan, KeptReport]:
    """Kept pixels for this run (tasks/ingest/kept.py): the side it keeps copies at (recorded), and the planned
    items read from another model's copies instead of the catalogue, past the gate; logged with the reason. When
    copies are read, what a decode costs (which splits the cores between decoding and the encoder) is measured on
    them too, weighted by their share of the work."""
    store = Location(store_url)
    side = pixels.keep_side(store, spec.slug, asked, kept.source_model(store, spec.slug), run_id)
    if side and chosen is not None and chosen.decoder == decoders.NVJPEG:
        raise decoders.DecoderError(f"--keep-pixels {side}: copies are made from a CPU decode, and model={spec.slug}"
                                    " decodes its JPEGs with nvjpeg; keep pixels off (--keep-pixels 0) on GPU nodes")
    if chosen is None:  # nothing to decode this run
        return plan, kept.KeptReport(side=side, why="nothing to decode")
    encoder = encoders.load(spec, device, chosen.runtime, chosen.precision)
    decode = decoders.Decode(chosen.decoder, chosen.decode_side or None)
    plan, report = kept.plan_kept(store, spec, encoder, plan, side, run_id, decode)
    if report.planned_from_kept and chosen.decode_seconds:  # the cores split by what the run decodes: mostly copies
        report.copy_decode_seconds = kept.copy_cost(store, report.source, plan, encoder, max_pixels, decode.side)
        if report.copy_decode_seconds:
            share = report.planned_from_kept / max(plan.to_read, 1)
            report.decode_seconds = share * report.copy_decode_seconds + (1 - share) * chosen.decode_seconds
    logger = get_run_logger()
    logger.info("kept pixels: %s; reading %s: %s", f"a copy of each image decoded at side {side}" if side else
                "none kept by this run", report.reads, report.why)
    if report.gate is not None and not report.gate.get("passed"):
        logger.warning("kept pixels not used: %s", report.why)
    return plan, report


@task(name="load-state", cache_policy=NO_CACHE, **IO_RETRIES)
def prepare_state_task(store_url: str, spec_description: dict, catalogue_url: str) -> tuple[CatalogueState, list[str]]:
    store = Location(store_url)
    prepared = prepare_state(store, spec_description)
    # readers of the rows' image uris (train-head, duplicates' thumbnails) read only under this root
    record_root(store, spec_description["slug"], Location(catalogue_url, follow_links=True))
    return prepared


LIST_PARALLEL = 16  # parts of a listing in flight at once


@task(name="list-catalogue", cache_policy=NO_CACHE)
def list_catalogue_task(catalogue_url: str) -> Listing:
    return list_side_by_side(catalogue_url, get_run_logger())


def list_side_by_side(catalogue_url: str, logger) -> Listing:
    """The catalogue's listing: the objects at the top and each top-level folder listed side by side, in
    LIST_PARALLEL threads (a LIST waits on the store, not on this host's cores), each part retried on its own as
    IO_RETRIES retries a task (its retries logged to `logger`); merged in key order. A catalogue without folders
    is one part."""
    folders = io_retrying("listing the catalogue's top-level folders", logger)(catalogue_parts, catalogue_url)
    parts = [("", 1)] + [(folder, None) for folder in folders] if folders else [("", None)]

    def listed(part: tuple[str, int | None]) -> Listing:
        folder, depth = part
        what = f"listing {folder}/ of the catalogue" if folder else "listing the catalogue's top"
        return io_retrying(what, logger)(list_catalogue, catalogue_url, folder, depth)

    with ThreadPoolExecutor(min(LIST_PARALLEL, len(parts)), thread_name_prefix="list") as pool:
        futures = [pool.submit(listed, part) for part in parts]
        try:
            listings = [future.result() for future in futures]
        except BaseException:  # the run stops: the parts not yet started are not
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return merge_listings(listings)


@task(name="read-inventory", cache_policy=NO_CACHE, timeout_seconds=LIST_TIMEOUT_S, **IO_RETRIES)
def read_inventory_task(manifest_url: str, catalogue_url: str) -> Listing:
    return read_inventory(manifest_url, catalogue_url)


@task(name="store-metadata", cache_policy=NO_CACHE, **IO_RETRIES)
def store_metadata_task(store_url: str, metadata_url: str, listing: Listing) -> MetadataReport:
    """Read and check the metadata file, store a snapshot if a row changed; rows and images that do not
    meet are counted against this run's listing."""
    return store_metadata(Location(store_url), metadata_url, listing)


@task(name="list-texts", cache_policy=NO_CACHE, **IO_RETRIES)
def text_listing_task(store_url: str, listing: Listing, spec: EncoderSpec) -> tuple[Listing, dict, int]:
    """A text model's listing: the stored metadata's rows with text, for listed images; and the snapshot."""
    store = Location(store_url)
    seq = latest_seq(store)
    if not seq:
        raise NoMetadataError(f"{spec.name} embeds catalogue text, and this store holds no metadata yet: pass "
                              "--metadata FILE_OR_URL (Parquet, CSV or JSONL with item_id, title, caption, ...)")
    with store.parquet_file(snapshot_key(seq)) as snapshot:  # streamed: never the whole snapshot in memory
        texts, left_out = text_listing(listing, snapshot, spec)
    return texts, left_out | {"metadata_snapshot": seq}, seq


@task(name="plan-shards", cache_policy=NO_CACHE)
def plan_ingest_task(store_url: str, listing: Listing, state: CatalogueState, run_id: str, shard_size: int,
                     max_bytes: int, max_delete_fraction: float | None) -> Plan:
    try:
        return plan_ingest(listing, state, run_id, shard_size, max_bytes, max_delete_fraction)
    except MassDeleteError as exc:  # the run stops before writing; whoever watches the store is told
        emit("imgest.delete.refused", store_url, state.slug, {"message": str(exc),
                                                               "max_delete_fraction": max_delete_fraction})
        raise


@task(name="attach-base-embeddings", cache_policy=NO_CACHE)
def attach_base_task(store_url: str, base_slug: str, plan: Plan) -> Plan:
    base = load_state(Location(store_url), base_slug)
    try:
        return attach_base(plan, base)
    finally:
        base.close()  # its database's memory goes now, not when the flow ends


@task(name="commit", cache_policy=NO_CACHE, timeout_seconds=COMMIT_TIMEOUT_S, **IO_RETRIES)
def commit_run_task(store_url: str, state: CatalogueState, plan: Plan, results: list[ShardResult],
                    summary: RunSummary, fence: Fence | None = None) -> RunSummary:
    return commit_run(Location(store_url), state, plan, results, summary, fence)


def encode_slot_name(limit: str, device: str) -> str | None:
    """The Prefect global concurrency limit an encode task holds a slot of, or None.

    'auto': on CUDA, one limit per physical GPU (named by its UUID, whatever CUDA_VISIBLE_DEVICES
    says), so each GPU runs one encode task at a time however many workers share it; on CPU, none.
    'none': no limit. Any other value: that limit's name (shared by every worker that names it).
    """
    if limit == "none":
        return None
    if limit != "auto":
        return limit
    if not device.startswith("cuda"):
        return None
    import torch

    index = int(device.partition(":")[2] or torch.cuda.current_device())
    return f"imgest-gpu-{torch.cuda.get_device_properties(index).uuid}"


def ensure_limit(name: str, slots: int = 1) -> None:
    """Create the global concurrency limit with `slots` slots unless it exists (an operator may have sized it)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=slots))
            except ObjectAlreadyExists:
                pass  # another worker created it first


@contextmanager
def encode_slot(name: str | None) -> Iterator[None]:
    if name is None:
        yield
        return
    from prefect.concurrency.sync import concurrency

    ensure_limit(name)
    with concurrency(name, occupy=1, strict=True):
        yield


@task(name="encode-shard", cache_policy=NO_CACHE, **SHARD_RETRIES,
      task_run_name="encode-{plan.name}")
def encode_shard_task(plan: ShardPlan, job: ShardJob) -> ShardResult:
    # The spec crosses the task boundary; the weights are loaded (and compiled, behind the parity check that
    # the flow's choice passed on this hardware) here, once per worker process. A worker that cannot run the
    # run's runtime and precision fails its shard: a run never mixes two.
    encoder = encoders.load(job.spec, job.device, job.runtime, job.precision)
    with encode_slot(encode_slot_name(job.encode_limit, job.device)):
        if "image" not in job.spec.modalities:  # a caption model: its objects are the metadata snapshot's texts
            store = Location(job.store_url)
            with store.parquet_file(snapshot_key(job.metadata_seq)) as snapshot:  # its items' row groups only
                texts = shard_texts(snapshot, job.spec, (item.item_id for item in plan.items))
                get_run_logger().debug("%s: texts of %d items from %d snapshot rows (%d of %d row groups)",
                                       plan.name, len(plan.items), texts.rows_read, texts.groups_read,
                                       snapshot.metadata.num_row_groups)
            return encode_text_shard(plan, encoder, texts.texts, store, job.batch_size, job.fence, job.dtype)
        return encode_shard(plan, encoder, Location(job.catalogue_url, follow_links=True), Location(job.store_url),
                            job.batch_size, job.decode_workers, job.max_pixels, job.fence, job.dtype, costs=job.costs,
                            decoder=job.decoder, decode_side=job.decode_side, keep_side=job.keep_side,
                            kept_source=job.kept_source)
