"""One shard: read and decode ahead in threads (bounded), encode in batches, write through ShardWriter."""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE

from imgest import encoders
from imgest.encoders import Encoder, EncoderSpec
from imgest.storage import Location
from tasks.decode import DEFAULT_MAX_PIXELS, DecodeError, decode_image
from tasks.plan import ShardPlan, WorkItem
from tasks.shards import ShardResult, ShardWriter


@dataclass
class Prepared:
    item: WorkItem
    content_hash: str | None = None
    pixels: np.ndarray | None = None
    reason: str | None = None  # rejected
    unchanged: bool = False
    vanished: bool = False


def prepare(catalogue: Location, item: WorkItem, preprocess: Callable, max_pixels: int) -> Prepared:
    """Read, hash, decode and preprocess one object; every failure of the object itself is a verdict."""
    try:
        data = catalogue.read_bytes(item.item_id)
    except FileNotFoundError:
        return Prepared(item, vanished=True)
    digest = hashlib.sha256(data).hexdigest()
    if item.prev_hash == digest:
        return Prepared(item, digest, unchanged=True)
    try:
        pixels = preprocess(decode_image(data, max_pixels))
    except DecodeError as exc:
        return Prepared(item, digest, reason=str(exc))
    except Exception as exc:  # the model's preprocessing refused this image (e.g. 1x1 pixels)
        return Prepared(item, digest, reason=f"{type(exc).__name__} in preprocessing: {exc}")
    return Prepared(item, digest, pixels)


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


def encode_shard(plan: ShardPlan, encoder: Encoder, catalogue: Location, store: Location, batch_size: int,
                 decode_workers: int = 2, max_pixels: int = DEFAULT_MAX_PIXELS) -> ShardResult:
    start = time.perf_counter()
    writer = ShardWriter(store, encoder.spec, plan)
    batch: list[Prepared] = []
    encode_seconds = wait_seconds = 0.0

    def flush_batch() -> None:
        nonlocal encode_seconds
        t0 = time.perf_counter()
        vectors = encoder.encode_images(np.stack([p.pixels for p in batch]))
        encode_seconds += time.perf_counter() - t0
        writer.add([(p.item, p.content_hash) for p in batch], vectors)
        batch.clear()

    depth = max(2 * batch_size, 4 * decode_workers)
    stream = read_ahead(plan.items, lambda it: prepare(catalogue, it, encoder.preprocess, max_pixels),
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
        elif prepared.reason is not None:
            writer.reject(prepared.item, prepared.content_hash, prepared.reason)
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


@task(name="encode-shard", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[5, 30],
      task_run_name="encode-{plan.name}")
def encode_shard_task(plan: ShardPlan, spec: EncoderSpec, device: str, catalogue_url: str, store_url: str,
                      batch_size: int, decode_workers: int, max_pixels: int) -> ShardResult:
    # The spec crosses the task boundary; the weights are loaded here, once per worker process.
    encoder = encoders.load(spec, device)
    return encode_shard(plan, encoder, Location(catalogue_url), Location(store_url), batch_size,
                        decode_workers, max_pixels)
