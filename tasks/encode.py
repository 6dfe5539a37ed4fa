"""One shard: read and decode ahead in threads (bounded), encode in batches, write through ShardWriter."""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE

from imgest import encoders
from imgest.defaults import DEFAULT_DECODE_WORKERS, DEFAULT_DTYPE, DEFAULT_MAX_PIXELS
from imgest.encoders import Encoder, EncoderSpec
from imgest.lock import Fence
from imgest.storage import Location, StorageError, is_transient, one_line
from imgest.tasks.decode import DecodeError, decode_image
from imgest.tasks.plan import ShardPlan, WorkItem
from imgest.tasks.policy import SHARD_RETRIES
from imgest.tasks.shards import ShardResult, ShardWriter, embedding_matrix
from imgest.tasks.state import shard_key


class ShardFailedError(RuntimeError):
    """A shard task failed after its retries; one line naming the shard and, through its cause, the object."""


@dataclass
class Prepared:
    item: WorkItem
    content_hash: str | None = None
    pixels: np.ndarray | None = None
    reason: str | None = None  # rejected (or failed, when transient)
    transient: bool = False  # a fault of the moment (timeout, throttling, memory): retried next run
    unchanged: bool = False
    revived: bool = False
    vanished: bool = False


def prepare(catalogue: Location, item: WorkItem, preprocess: Callable, max_pixels: int,
            min_side: int | None = None) -> Prepared:
    """Read, hash, decode and preprocess one object. Whatever goes wrong with the object itself is a verdict
    recorded against it; only a catalogue that cannot be reached at all fails the shard (and so the run)."""
    if item.verdict is not None:
        return Prepared(item, reason=item.verdict)
    try:
        data = catalogue.read_bytes(item.item_id)
    except FileNotFoundError:
        return Prepared(item, vanished=True)
    except (StorageError, MemoryError) as exc:
        transient = is_transient(exc)
        if transient and not catalogue_reachable(catalogue):
            raise  # the store's failure, not the object's: the task fails, retries, and the run stops
        return Prepared(item, reason=one_line(exc.__cause__ or exc), transient=transient)
    digest = hashlib.sha256(data).hexdigest()
    if item.prev_hash == digest:
        return Prepared(item, digest, revived=item.revive_shard is not None, unchanged=item.revive_shard is None)
    try:
        pixels = preprocess(decode_image(data, max_pixels, min_side))
    except DecodeError as exc:
        return Prepared(item, digest, reason=str(exc))
    except MemoryError as exc:
        return Prepared(item, digest, reason=f"{type(exc).__name__} while decoding: {exc}", transient=True)
    except Exception as exc:  # the model's preprocessing refused this image (e.g. 1x1 pixels)
        return Prepared(item, digest, reason=f"{type(exc).__name__} in preprocessing: {exc}")
    return Prepared(item, digest, pixels)


def catalogue_reachable(catalogue: Location) -> bool:
    try:
        return catalogue.exists("")
    except StorageError:
        return False


def read_ahead(items: tuple[WorkItem, ...], fn: Callable[[WorkItem], Prepared], workers: int,
               depth: int) -> Iterator[Prepared]:
    """Yield ``fn(item)`` in order while up to ``depth`` items are in flight: memory stays flat."""
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="imgest-decode") as pool:
        pending: deque[Future] = deque()
        source = iter(items)
        for item in source:
            pending.append(pool.submit(fn, item))
            if len(pending) >= depth:
                break
        while pending:
            done = pending.popleft().result()
            nxt = next(source, None)
            if nxt is not None:
                pending.append(pool.submit(fn, nxt))
            yield done


def derive_from_base(items: tuple[WorkItem, ...], encoder: Encoder, store: Location,
                     writer: ShardWriter) -> tuple[WorkItem, ...]:
    """A head model: items whose base embedding is current get the head applied to it, read from the
    base model's shard (no image decoded); returns the items that still have to be read."""
    from imgest.encoders.head import project

    base_slug = encoder.spec.base.slug
    by_shard: dict[str, list[WorkItem]] = {}
    rest = []
    for item in items:
        if item.verdict is not None:
            rest.append(item)  # rejected from its listing: prepare() records it
        elif item.base_shard and item.base_hash and item.prev_hash == item.base_hash and item.revive_shard:
            writer.revive(item, item.base_hash)  # back with the bytes of the head's tombstone: its row serves
        elif item.base_shard and item.base_hash and item.prev_hash == item.base_hash:
            writer.unchanged(item, item.base_hash)  # same bytes as the head's own row: nothing to do
        elif item.base_shard:
            by_shard.setdefault(item.base_shard, []).append(item)
        else:
            rest.append(item)
    for base_shard, group in sorted(by_shard.items()):
        table = store.read_table(shard_key(base_slug, base_shard), columns=["item_id", "content_hash", "embedding"])
        rows = {(i, h): n for n, (i, h) in enumerate(zip(table.column("item_id").to_pylist(),
                                                         table.column("content_hash").to_pylist()))}
        found = [(item, rows[(item.item_id, item.base_hash)]) for item in group
                 if (item.item_id, item.base_hash) in rows]
        rest.extend(item for item in group if (item.item_id, item.base_hash) not in rows)  # not there: decode
        if not found:
            continue
        base = embedding_matrix(table, encoder.spec.base.dim)[[n for _, n in found]]
        writer.add([(item, item.base_hash) for item, _ in found], project(encoder.module, base, encoder.device))
        writer.result.derived += len(found)
    order = {item.item_id: n for n, item in enumerate(items)}
    return tuple(sorted(rest, key=lambda it: order[it.item_id]))


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


def encode_shard(plan: ShardPlan, encoder: Encoder, catalogue: Location, store: Location, batch_size: int,
                 decode_workers: int = DEFAULT_DECODE_WORKERS, max_pixels: int = DEFAULT_MAX_PIXELS,
                 fence: Fence | None = None, dtype: str = DEFAULT_DTYPE) -> ShardResult:
    start = time.perf_counter()
    writer = ShardWriter(store, encoder.spec, plan, fence, dtype)
    writer.result.worker, writer.result.started = f"{socket.gethostname()}:{os.getpid()}", _now()
    batch: list[Prepared] = []
    encode_seconds = wait_seconds = 0.0

    def flush_batch() -> None:
        nonlocal encode_seconds
        t0 = time.perf_counter()
        vectors = encoder.encode_images(np.stack([p.pixels for p in batch]))
        encode_seconds += time.perf_counter() - t0
        writer.add([(p.item, p.content_hash) for p in batch], vectors)
        batch.clear()

    to_read = derive_from_base(plan.items, encoder, store, writer) if encoder.spec.base is not None else plan.items
    depth = max(2 * batch_size, 4 * decode_workers)
    decode_side = getattr(encoder, "decode_side", None)  # JPEGs decode at reduced size down to this
    stream = read_ahead(to_read, lambda it: prepare(catalogue, it, encoder.preprocess, max_pixels, decode_side),
                        decode_workers, depth)
    while True:
        t0 = time.perf_counter()
        prepared = next(stream, None)
        wait_seconds += time.perf_counter() - t0
        if prepared is None:
            break
        if prepared.vanished:
            writer.vanished(prepared.item)
        elif prepared.unchanged:
            writer.unchanged(prepared.item, prepared.content_hash)
        elif prepared.revived:
            writer.revive(prepared.item, prepared.content_hash)
        elif prepared.reason is not None:
            writer.reject(prepared.item, prepared.content_hash, prepared.reason, prepared.transient)
        else:
            batch.append(prepared)
            if len(batch) >= batch_size:
                flush_batch()
    if batch:
        flush_batch()
    result = writer.flush()
    result.seconds = round(time.perf_counter() - start, 3)
    result.encode_seconds, result.wait_seconds = round(encode_seconds, 3), round(wait_seconds, 3)
    return result


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
def encode_shard_task(plan: ShardPlan, spec: EncoderSpec, device: str, catalogue_url: str, store_url: str,
                      batch_size: int, decode_workers: int, max_pixels: int, encode_limit: str = "auto",
                      fence: Fence | None = None, dtype: str = DEFAULT_DTYPE) -> ShardResult:
    # The spec crosses the task boundary; the weights are loaded here, once per worker process.
    encoder = encoders.load(spec, device)
    with encode_slot(encode_slot_name(encode_limit, device)):
        return encode_shard(plan, encoder, Location(catalogue_url), Location(store_url), batch_size,
                            decode_workers, max_pixels, fence, dtype)
