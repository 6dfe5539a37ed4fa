"""Where a shard's decoding runs: the plan (threads or processes, how many, at what priority), the workers
(decode processes kept from one shard to the next) and the bounded read-ahead over them.

On 2 CPU cores the model and the JPEG decoder compete for the same cores, and measured (BENCHMARKS.md,
"Threads or processes for decoding") the split that wins is one core each, with the decode in a process (no
GIL shared with the encoder's thread): 0.71 x the bare model against 0.66 for one decode thread and 0.60 for
two decode threads beside two torch threads. So with --decode-workers 0 (the default) the cores are split
between decode and encoder in the proportion of their measured cost per image (the run measures both before
its first shard; half each when it has not), all but one decode on a GPU, where the model does not need them;
a shard with enough images to pay for starting them decodes in processes when the encoder's preprocessing can
run in one, and their pixels come back through shared memory (tasks/ingest/handoff.py). Where the decode's share
rounds to no core (a ViT-B's encoder costs 30 times its decode), the encoder keeps every core and niced decode
processes take what it leaves idle: one encoder thread beside them reached only 0.52 of the work bound on 2 cores.

Starting a decode process costs about half a core-second (the interpreter and its imports): two of them for
every shard cost 4-6% of the images/s of a 1,500-photo shard on 2 cores (measured 2026-12-05). So a shard
that ends normally leaves its processes to the next shard of the same plan, started in the same environment
(they read the catalogue with the credentials they inherited); they end with the run's encoding (`end_kept`),
after `KEEP_IDLE_SECONDS` without a shard, with the process that started them, or when a shard needs others.
"""

from __future__ import annotations

import hashlib
import itertools
import multiprocessing
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import CancelledError, Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from imgest.encoders import Encoder

PROCESS_MIN_ITEMS = 64  # fewer images to decode than this: starting processes costs more than it saves
DECODE_NICE = 10  # how far below the encoder decode processes run when they outnumber their share of the cores
CHUNK = 4  # objects per call to a decode process (read_ahead)
KEEP_IDLE_SECONDS = 60.0  # a run's next shard starts within seconds; a process serving flows does not hold them

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass(frozen=True)
class DecodePlan:
    workers: int
    processes: bool
    torch_threads: int | None  # set for the shard's encode (CPU), restored after; None: leave as it is
    nice: int = 0  # decode processes this much below the encoder: they take the cores it leaves idle

    def describe(self) -> str:
        kind = ("process" if self.processes else "thread") + ("es" if self.processes and self.workers > 1 else
                                                              "s" if self.workers > 1 else "")
        return f"{self.workers} decode {kind}" + (f" (nice {self.nice})" if self.nice else "") + \
            (f", torch {self.torch_threads} thread(s)" if self.torch_threads else "")


def plan_decode(encoder: Encoder, decode_workers: int, to_read: int, gpu_jpeg: bool,
                costs: tuple[float, float] | None = None) -> DecodePlan:
    """How many decode workers, threads or processes, and the encoder's threads beside them (module docstring).
    With `costs` (decode and encode core-seconds per image, measured by the run), a CPU's cores are split in
    their proportion; without, in half. Decode processes on a CPU get one more than their share, at a lower
    priority: the encoder's threads take their cores when they have work, the decoders what they leave idle
    (measured on 2 cores: +7-11% images/s over one decode process beside one encoder thread)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    on_gpu = str(getattr(encoder, "device", "cpu")).startswith("cuda")
    processes = (getattr(encoder, "preprocess_fn", None) is not None and to_read >= PROCESS_MIN_ITEMS
                 and not gpu_jpeg  # a GPU decode leaves the workers only reading and hashing
                 and not multiprocessing.current_process().daemon)  # a Dask worker may not start processes
    torch_threads, nice = None, 0
    if decode_workers == 0:
        share = costs[0] / sum(costs) if costs and all(c and c > 0 for c in costs) else 0.5
        wanted = round(cores * share)  # the decode's share of the cores, in whole cores
        decode_workers = max(1, cores - 1) if on_gpu else min(max(1, wanted), max(1, cores - 1))
        torch_threads = None if on_gpu else max(1, cores - decode_workers)
        if processes and not on_gpu and cores > 1:
            decode_workers, nice = decode_workers + 1, DECODE_NICE
            if not wanted:  # under half a core (a ViT: decode ~3% of the work): the encoder keeps every core,
                torch_threads = cores  # the niced decode processes take what it leaves idle
    return DecodePlan(decode_workers, processes, torch_threads, nice)


def _exit_with_parent(parent: int, nice: int = 0) -> None:
    """In a decode process: end when the process that started it is gone (killed with -9, say), instead of
    waiting for work that will never come; at a lower priority when `nice` (it yields to the encoder)."""
    if nice:
        os.nice(nice)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="imgest-parent-watch", daemon=True).start()


def decode_pool(plan: DecodePlan) -> Executor:
    """New workers for `plan`."""
    if plan.processes:  # spawn: never fork a process that holds torch's and Prefect's threads
        return ProcessPoolExecutor(plan.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_exit_with_parent, initargs=(os.getpid(), plan.nice))
    return ThreadPoolExecutor(max_workers=plan.workers, thread_name_prefix="imgest-decode")


# The processes a shard left (module docstring): its plan and environment, the pool, the timer that ends it.
_kept: tuple[tuple, Executor, threading.Timer] | None = None
_kept_lock = threading.Lock()


def _environment() -> str:
    """What a decode process inherited that its reads depend on (credentials, endpoints), as a digest."""
    return hashlib.sha256(repr(sorted(os.environ.items())).encode()).hexdigest()


def _take_kept() -> tuple[tuple, Executor, threading.Timer] | None:
    """The processes a shard left, if any, now no longer kept (their timer stopped)."""
    global _kept
    with _kept_lock:
        left, _kept = _kept, None
    if left is not None:
        left[2].cancel()
    return left


def _expire(pool: Executor) -> None:
    global _kept
    with _kept_lock:
        if _kept is None or _kept[1] is not pool:  # taken by a shard, or replaced, since the timer started
            return
        _kept = None
    pool.shutdown(wait=True)


class DecodeWorkers:
    """One shard's decode workers, a context manager: the processes kept from the shard before when they were
    started for the same plan in the same environment, new ones otherwise. A shard that ends normally leaves
    its processes for the next one; a shard that fails stops them (what had not started is cancelled)."""

    def __init__(self, plan: DecodePlan):
        self.plan, self.key, self.kept, self.finished = plan, (plan, _environment()), False, False
        if (left := _take_kept()) is not None:
            if plan.processes and left[0] == self.key:
                self.pool, self.kept = left[1], True
                return
            left[1].shutdown(wait=False, cancel_futures=True)
        self.pool = decode_pool(plan)

    def describe(self) -> str:
        return self.plan.describe() + (", kept from the shard before" if self.kept else "")

    def renew(self) -> Executor:
        """The pool broke (a process died): new workers in its place."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.pool = decode_pool(self.plan)
        return self.pool

    def __enter__(self) -> DecodeWorkers:
        return self

    def __exit__(self, kind, *_) -> None:
        global _kept
        if kind is not None or not self.finished or not self.plan.processes:
            self.pool.shutdown(wait=True, cancel_futures=True)
            return
        timer = threading.Timer(KEEP_IDLE_SECONDS, _expire, (self.pool,))
        timer.daemon = True
        with _kept_lock:  # one swap: a shard on another thread may keep its own meanwhile
            left, _kept = _kept, (self.key, self.pool, timer)
        timer.start()
        if left is not None:  # another shard's, kept while this one ran (shards on two threads)
            left[2].cancel()
            left[1].shutdown(wait=False)


def end_kept() -> None:
    """End the processes the last shard left: the run has no shard for them (its index build wants the memory)."""
    if (left := _take_kept()) is not None:
        left[1].shutdown(wait=True)


def _alone(fn: Callable[[Item, int], Result], item: Item, position: int, died: Callable[[Item], Result]) -> Result:
    """One object in a fresh decode process of its own: its result, or `died(item)` if that dies too."""
    with decode_pool(DecodePlan(1, True, None)) as solo:
        try:
            return solo.submit(fn, item, position).result()
        except BrokenProcessPool:
            return died(item)


def _each(fn: Callable[[Item, int], Result], chunk: list[tuple[Item, int]]) -> list[Result]:
    """In a worker: one call's objects, in order."""
    return [fn(item, at) for item, at in chunk]


def read_ahead(items: Iterable[Item], fn: Callable[[Item, int], Result], workers: DecodeWorkers, depth: int,
               died: Callable[[Item], Result]) -> Iterator[Result]:
    """Yield ``fn(item, position)`` in order on `workers` while up to ``depth`` items are in flight: memory stays
    flat. Closing the generator early (the shard failed) cancels what has not started; `workers` stop the rest.
    An object is sent only once the one ``depth`` places before it has been taken by the consumer (the hand-off's
    slots rely on it). Every item yielded, `workers.finished` is set: their processes may serve the next shard.

    A decode process gets `CHUNK` objects a call (a call costs it and the encoder's process about 0.5 ms each).
    A decode process that dies (the kernel's OOM killer, a crash inside a decoder) breaks its pool: each object
    of the call being waited for is tried again alone, in a process of its own, and `died(item)` if that dies
    too (one object's fault); the objects in flight go to new workers. Threads never break a pool."""
    pool, size = workers.pool, CHUNK if workers.plan.processes else 1
    pending: deque[tuple[list[tuple[Any, int]], Future]] = deque()
    source = iter(enumerate(items))
    sent = taken = 0

    def renew() -> None:
        """The pool broke: new workers, and every call in flight that did not finish sent to them."""
        nonlocal pool
        pool = workers.renew()
        for n, (chunk, fut) in enumerate(pending):
            if fut.cancelled() or isinstance(fut.exception(), BrokenProcessPool):
                pending[n] = (chunk, pool.submit(_each, fn, chunk))

    def fill() -> None:
        """Send whole calls while the objects sent and not yet taken stay within `depth`."""
        nonlocal sent
        while sent - taken + size <= max(depth, size):
            chunk = [(item, at) for at, item in itertools.islice(source, size)]
            if not chunk:
                return
            try:
                pending.append((chunk, pool.submit(_each, fn, chunk)))
            except BrokenProcessPool:  # broken by an object before, or kept from a shard whose last one broke it
                renew()
                pending.append((chunk, pool.submit(_each, fn, chunk)))
            sent += len(chunk)

    try:
        fill()
        while pending:
            chunk, future = pending.popleft()
            try:
                results = future.result()
            except (BrokenProcessPool, CancelledError):  # an object of this call, or of one beside it, killed it
                results = [_alone(fn, item, at, died) for item, at in chunk]
                renew()
            for done in results:
                yield done
                taken += 1  # the consumer asks again once it has copied the object out
                fill()
        workers.finished = True
    finally:
        for _, future in pending:
            future.cancel()
