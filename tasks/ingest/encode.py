"""One shard: read and decode ahead (tasks/ingest/decode_workers.py), encode in batches, write the shard."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np

from imgest.encoders import Encoder
from imgest.images import decoders, kept
from imgest.images.decode import DecodeError, decode_image
from imgest.names import DEFAULT_DECODE_WORKERS, DEFAULT_DTYPE, DEFAULT_MAX_PIXELS
from imgest.state import pixels
from imgest.state.lock import Fence
from imgest.storage import Location, StorageError, is_transient, one_line
from imgest.tasks.ingest import handoff
from imgest.tasks.ingest.decode_workers import DecodeWorkers, plan_decode, read_ahead
from imgest.tasks.ingest.derive import derive_from_base
from imgest.tasks.ingest.gpu_decode import BatchJpegDecoder, plain_jpeg
from imgest.tasks.ingest.plan import ShardPlan, WorkItem
from imgest.tasks.ingest.writer import ShardResult, ShardWriter
from imgest.timing import Stopwatch


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
    jpeg: bytes | None = None  # bytes for the batch's GPU decode (tasks/ingest/gpu_decode.py), pixels not yet made
    slot: tuple | None = None  # (slot, shape, dtype): the pixels wait in the shared hand-off block
    copy: tuple[bytes, int, int] | None = None  # kept pixels to write: (JPEG bytes, width, height)
    from_kept: bool = False  # decoded from a kept copy, not the catalogue's original
    copy_fault: str | None = None  # the copy could not be made (the item is encoded all the same, kept without one)


def prepare(catalogue: Location, item: WorkItem, preprocess: Callable, max_pixels: int,
            min_side: int | None = None, gpu_jpeg: bool = False, decoder: str = decoders.PILLOW,
            keep_side: int = 0, copy: bytes | None = None) -> Prepared:
    """Read, hash, decode and preprocess one object. Whatever goes wrong with the object itself is a verdict
    recorded against it; only a catalogue that cannot be reached at all fails the shard (and so the run).
    With `gpu_jpeg`, a plain JPEG is left undecoded: its bytes go to the batch's GPU decode; `decoder` is the
    CPU's JPEG decoder (imgest/images/decoders.py). With `copy` (a kept copy of the item's bytes, `item.kept_hash`),
    the copy is decoded instead of the original, which is read only if the copy does not decode. With `keep_side`,
    a copy of the image at that side comes back to be kept (imgest/images/kept.py): the copy read, when it has
    that side; else one made from the model's decode when that has the side, or from a second decode at
    `keep_side`. The model's pixels always come from its own decode down to `min_side`: keeping pixels never
    changes a vector."""
    if item.verdict is not None:
        return Prepared(item, reason=item.verdict)
    if copy is not None and (done := _from_copy(item, copy, preprocess, max_pixels, min_side, keep_side)) is not None:
        return done
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
    if gpu_jpeg and plain_jpeg(data, max_pixels):
        return Prepared(item, digest, jpeg=data)
    try:
        image = decode_image(data, max_pixels, min_side, decoder)
        pixels = preprocess(image)
    except DecodeError as exc:
        return Prepared(item, digest, reason=str(exc))
    except MemoryError as exc:
        return Prepared(item, digest, reason=f"{type(exc).__name__} while decoding: {exc}", transient=True)
    except Exception as exc:  # the model's preprocessing refused this image (e.g. 1x1 pixels)
        return Prepared(item, digest, reason=f"{type(exc).__name__} in preprocessing: {exc}")
    if not keep_side:
        return Prepared(item, digest, pixels)
    try:  # the copy is storage only: an item whose copy cannot be made is encoded all the same, without one
        copy = kept.make_copy(_at_side(image, data, keep_side, max_pixels, decoder, min_side), keep_side)
    except Exception as exc:  # a second decode's MemoryError too: the next model reads this item's original
        return Prepared(item, digest, pixels, copy_fault=f"{item.item_id}: no kept copy ({type(exc).__name__}: "
                                                         f"{str(exc)[:200]})")
    return Prepared(item, digest, pixels, copy=copy)


def _at_side(image, data: bytes, side: int, max_pixels: int, decoder: str, min_side: int | None):
    """The image a copy at `side` is made from: the model's decode (down to `min_side`) when it is whole or its
    shorter side already reaches `side` (a DCT-scaled decode is then the one a decode at `side` makes), else the
    bytes decoded again at `side`."""
    if not min_side or min(image.size) >= side:
        return image
    return decode_image(data, max_pixels, side, decoder)


def _from_copy(item: WorkItem, copy: bytes, preprocess: Callable, max_pixels: int, min_side: int | None,
               keep_side: int) -> Prepared | None:
    """An item prepared from its kept copy; None when the copy does not decode (the original is read instead)."""
    if item.prev_hash == item.kept_hash:  # the model's own row already has these bytes
        return Prepared(item, item.kept_hash, revived=item.revive_shard is not None,
                        unchanged=item.revive_shard is None)
    try:
        image = decode_image(copy, min(max_pixels, kept.MAX_COPY_PIXELS), min_side)  # Pillow: the copies' decoder
        pixels = preprocess(image)
    except Exception:  # a damaged copy: the original decides
        return None
    if keep_side and kept.reduction(image.size, keep_side) == 1:
        kept_copy = (copy, *image.size)  # the copy as it is: no second lossy encode
    else:
        kept_copy = kept.make_copy(image, keep_side) if keep_side else None
    return Prepared(item, item.kept_hash, pixels, copy=kept_copy, from_kept=True)


def stack_pixels(pixels: list):
    """One batch: NumPy arrays stack on the host; with tensors from a GPU decode, on their device."""
    if all(isinstance(p, np.ndarray) for p in pixels):
        return np.stack(pixels)
    import torch

    device = next(p.device for p in pixels if not isinstance(p, np.ndarray))
    return torch.stack([torch.tensor(p, device=device) if isinstance(p, np.ndarray) else p for p in pixels])


def catalogue_reachable(catalogue: Location) -> bool:
    try:
        return catalogue.reachable()
    except StorageError:
        return False


DIED = ("the decode process died on this object (killed or crashed: out of memory, or a fault in the image "
        "decoder); the other objects were decoded in a new process")
READ_AHEAD_MIN = 32  # in flight at least: a run of slow objects (PNG cut-outs, EXIF turns) must not starve the model


@dataclass(frozen=True)
class DecodeCost:
    """What decoding costs a run: core-seconds per image with the JPEG decoder it chose, and each one tried."""

    seconds: float
    decoder: str
    measured: dict[str, float]  # decoder -> core-seconds per image (decode, preprocess, hash)


def decode_cost(catalogue: Location, items: tuple[WorkItem, ...], encoder: Encoder, max_pixels: int,
                sample: int = 16, names: tuple[str, ...] | None = None, side: int | None = None) -> DecodeCost | None:
    """What a decode worker's work (read, hash, decode, preprocess) costs per image, in core-seconds, with the
    fastest of the JPEG decoders `names` (default: the CPU ones installed here), measured on up to `sample` of
    `items` in this thread (CPU time: waits on the store do not count). None without a sample that decodes, or
    when the catalogue cannot be read now: the shards meet that fault themselves and name it. JPEGs decode down to
    `side` (0: the whole image; None: the encoder's side)."""
    side = decoders.min_side(encoder, side)
    start, datas = time.thread_time(), []
    try:
        for item in items[:sample]:
            if item.verdict is None:
                with contextlib.suppress(FileNotFoundError):
                    datas.append(catalogue.read_bytes(item.item_id))
    except (StorageError, OSError):
        return None
    reading = time.thread_time() - start

    def work(data: bytes, decoder: str):
        hashlib.sha256(data).hexdigest()
        return encoder.preprocess(decode_image(data, max_pixels, side, decoder))

    def decodes(data: bytes) -> bool:
        try:
            work(data, decoders.PILLOW)
        except Exception:  # an object the run will reject: its cost is not a decode's
            return False
        return True

    datas = [data for data in datas if decodes(data)]
    if not datas:
        return None
    chosen, measured = decoders.fastest(datas, work, names)
    return DecodeCost(round(reading / len(datas) + measured[chosen], 6), chosen, measured)


@functools.lru_cache(maxsize=8)
def _catalogue(url: str) -> Location:
    return Location(url, follow_links=True)


def _prepare_in_process(catalogue_url: str, source: tuple[WorkItem, bytes | None], position: int,
                        preprocess: Callable, max_pixels: int, min_side: int | None,
                        slots: tuple[str, int, int] | None = None, decoder: str = decoders.PILLOW,
                        keep_side: int = 0) -> Prepared:
    """prepare() in a decode process: the catalogue travels as its URL (credentials come from the
    environment the process inherited), the preprocessing as a module-level function, a kept copy with its item.
    With `slots` (the shared block's name, its slot count and size), the pixels go into the object's slot
    (tasks/ingest/handoff.py) and only their shape and dtype come back."""
    item, copy = source
    done = prepare(_catalogue(catalogue_url), item, preprocess, max_pixels, min_side, decoder=decoder,
                   keep_side=keep_side, copy=copy)
    if slots is not None and done.pixels is not None:
        name, count, nbytes = slots
        if handoff.write(name, position % count, nbytes, done.pixels):
            done.slot, done.pixels = (position % count, done.pixels.shape, done.pixels.dtype.str), None
    return done


def with_copies(items: tuple[WorkItem, ...], store: Location, source_slug: str | None,
                faults: list[str]) -> Iterator[tuple[WorkItem, bytes | None]]:
    """The shard's objects to read, each with its kept copy or None: first those with a copy, a pixel file at a
    time (read a row group at a time as the decode asks for them), then the rest, to be read from the catalogue.
    A pixel file that cannot be trusted or read sends its items to the catalogue and says why in `faults`; an item
    whose copy is not in its file (another content hash, a row missing) goes to the catalogue too."""
    by_file: dict[tuple[str, int], dict[str, WorkItem]] = {}
    rest = []
    for item in items:
        if item.kept_shard and item.kept_hash and item.kept_side and source_slug and item.verdict is None:
            by_file.setdefault((item.kept_shard, item.kept_side), {})[item.item_id] = item
        else:
            rest.append(item)
    for (shard, side), group in sorted(by_file.items()):
        wanted = {item_id: item.kept_hash for item_id, item in group.items()}
        copies = pixels.read_copies(store, source_slug, side, shard, wanted)
        try:
            for found in copies:
                item = group.pop(found.item_id, None)
                if item is not None:  # a second row of an item (a file not written by imgest): the first stands
                    yield item, found.data
        except pixels.KeptPixelsError as exc:
            faults.append(f"{exc}: {len(group)} item(s) read from the catalogue")
        finally:
            copies.close()
        rest.extend(group.values())
    yield from ((item, None) for item in rest)


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    if n is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)




def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


def encode_shard(plan: ShardPlan, encoder: Encoder, catalogue: Location, store: Location, batch_size: int,
                 decode_workers: int = DEFAULT_DECODE_WORKERS, max_pixels: int = DEFAULT_MAX_PIXELS,
                 fence: Fence | None = None, dtype: str = DEFAULT_DTYPE,
                 jpeg_decoder: BatchJpegDecoder | None | str = "auto",
                 costs: tuple[float, float] | None = None, decoder: str = decoders.PILLOW, keep_side: int = 0,
                 kept_source: str | None = None, decode_side: int | None = None) -> ShardResult:
    """Encode one shard's objects and commit it, its JPEGs decoded by `decoder` down to `decode_side` (the run's:
    its model's recorded decode, imgest/images/decoders.py; 0 the whole image, None the encoder's side).
    `jpeg_decoder`: "auto" decodes them in batches on the GPU when `decoder` is nvJPEG
    (BatchJpegDecoder.for_encoder); None: one by one, on the CPU. A worker that cannot run the run's decoder fails
    its shard: a shard never holds vectors of another decoder than the one it names. Items planned with a kept copy
    (of `kept_source`'s pixel files) are decoded from it; with `keep_side`, each image decoded leaves a copy in the
    shard's pixel file, published before its commit marker (imgest/state/pixels.py)."""
    total, encoding, waiting = Stopwatch(), Stopwatch(running=False), Stopwatch(running=False)
    if jpeg_decoder == "auto":
        jpeg_decoder = BatchJpegDecoder.for_encoder(encoder, max_pixels) if decoder == decoders.NVJPEG else None
    device = str(getattr(encoder, "device", "cpu"))
    if plan.items and (why := decoders.unusable(decoder, device) or (
            decoder == decoders.NVJPEG and jpeg_decoder is None and f"{encoder.spec.name} has no GPU preprocessing")):
        raise decoders.DecoderError(f"shard {plan.name}: this run decodes JPEGs with {decoder}, which cannot run in "
                                    f"this worker: {why}")
    decode_side = decoders.min_side(encoder, decode_side)  # JPEGs decode at reduced size down to this (None: whole)
    writer = ShardWriter(store, encoder.spec, plan, fence, dtype, encoder.runtime, encoder.precision, decoder,
                         keep_side, decode_side or 0)
    writer.result.worker, writer.result.started = f"{socket.gethostname()}:{os.getpid()}", _now()
    batch: list[Prepared] = []

    def flush_batch() -> None:
        with encoding:
            encode_batch()
        batch.clear()

    def encode_batch() -> None:
        ready = batch
        if jpegs := [p for p in batch if p.jpeg is not None]:
            for p, pixels in zip(jpegs, jpeg_decoder.decode([p.jpeg for p in jpegs])):
                p.jpeg = None
                if isinstance(pixels, DecodeError):
                    writer.reject(p.item, p.content_hash, str(pixels))
                else:
                    p.pixels = pixels
            ready = [p for p in batch if p.pixels is not None]
        if ready:
            vectors = encoder.encode_images(stack_pixels([p.pixels for p in ready]))
            writer.add([(p.item, p.content_hash) for p in ready], vectors)

    to_read = derive_from_base(plan.items, encoder, store, writer) if encoder.spec.base is not None else plan.items
    if not to_read:  # every item derived from its stored base vector: no reader, decoder or torch thread
        return _finished(writer, total, encoding, waiting)
    gpu_jpeg = jpeg_decoder is not None
    if gpu_jpeg and keep_side:
        raise decoders.DecoderError(f"shard {plan.name}: kept pixels are made from a CPU decode; this model's "
                                    "JPEGs are decoded by nvJPEG")
    where = plan_decode(encoder, decode_workers, len(to_read), gpu_jpeg, costs)
    # measured on 1,500 product photos, 2 cores, OpenVINO at batch 4: 8 in flight left the encoder waiting 1.8 s
    # of 12 (126 img/s), 32 waited 0.9-1.1 s (136-142 img/s); a slot is one preprocessed image (150 kB for Lite0)
    depth = max(2 * batch_size, 4 * where.workers, READ_AHEAD_MIN)
    slots = None
    if where.processes:  # before anything is read: a block /dev/shm cannot hold kills the processes with SIGBUS
        slot = handoff.slot_bytes(encoder)
        handoff.check_room(depth + 1, slot)
        slots = handoff.PixelSlots(depth + 1, slot)
    if where.processes:
        fn = functools.partial(_prepare_in_process, catalogue.url, preprocess=encoder.preprocess_fn,
                               max_pixels=max_pixels, min_side=decode_side, slots=slots.address, decoder=decoder,
                               keep_side=keep_side)
    else:
        def fn(source: tuple[WorkItem, bytes | None], position: int) -> Prepared:
            return prepare(catalogue, source[0], encoder.preprocess, max_pixels, decode_side, gpu_jpeg, decoder,
                           keep_side, source[1])
    with contextlib.closing(slots) if slots is not None else contextlib.nullcontext(), \
            DecodeWorkers(where) as workers, torch_threads(where.torch_threads):
        writer.result.decode = workers.describe()
        sources = with_copies(to_read, store, kept_source, writer.result.kept_faults)
        stream = read_ahead(sources, fn, workers, depth, died=lambda source: Prepared(source[0], reason=DIED))
        with contextlib.closing(stream):
            while True:
                with waiting:
                    prepared = next(stream, None)
                if prepared is None:
                    break
                if prepared.slot is not None:  # copied out now: the slot is sent again depth + 1 objects later
                    prepared.pixels, prepared.slot = slots.read(*prepared.slot), None
                if prepared.vanished:
                    writer.vanished(prepared.item)
                elif prepared.unchanged:
                    writer.unchanged(prepared.item, prepared.content_hash)
                elif prepared.revived:
                    writer.revive(prepared.item, prepared.content_hash)
                elif prepared.reason is not None:
                    writer.reject(prepared.item, prepared.content_hash, prepared.reason, prepared.transient)
                else:
                    writer.keep(prepared.item, prepared.content_hash, prepared.copy, prepared.from_kept)
                    if prepared.copy_fault:
                        writer.result.kept_faults.append(prepared.copy_fault)
                    batch.append(prepared)
                    if len(batch) >= batch_size:
                        flush_batch()
        if batch:
            flush_batch()
    return _finished(writer, total, encoding, waiting)


def _finished(writer: ShardWriter, total: Stopwatch, encoding: Stopwatch, waiting: Stopwatch) -> ShardResult:
    result = writer.flush()
    result.seconds, result.encode_seconds, result.wait_seconds = total.seconds, encoding.seconds, waiting.seconds
    return result
