"""The compiled-model cache: a runtime's converted models, their parity records, the parity sample's reference
embeddings (imgest/encoders/parity.py) and the batch sizes measured on them (tasks/ingest/batch_size.py), on this
host's own disk.

An entry is a folder named by hashing what the converted model depends on: the model id (its weights'
revision and its preprocessing), the tower, the runtime and its version, the inputs' shapes and dtypes. A
changed revision, runtime release or input shape is a new entry, so it is converted again; nothing is ever
read back under another model's name. Entries are written into a temporary folder and renamed into place, so
a kill leaves no half-written entry. The processes of a host take turns at each job on the cache (a conversion, a
parity check, a measurement: `one_at_a_time`), so the second waits for the first and reads what it kept instead of
doing the same work beside it. The cache is local disk that imgest itself wrote: a worker never compiles from
bytes read out of a store.

`IMGEST_COMPILED_CACHE` moves it (default `~/.cache/imgest/compiled`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

try:
    import fcntl
except ImportError:  # not a POSIX system: the jobs run side by side, each ending whole
    fcntl = None

CACHE_ENV = "IMGEST_COMPILED_CACHE"
KEY_FILE, MODEL_FILE = "key.json", "model.xml"
TURN_WAIT_S = 900.0  # a job held longer than this (its process paused or stuck) is done again beside it


def root() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "imgest", "compiled")


@dataclass(frozen=True)
class Entry:
    folder: str
    key: dict[str, Any]


def entry(model_id: str, graph, runtime: str, runtime_version: str) -> Entry:
    key = {"model_id": model_id, "graph": graph.name, "runtime": runtime, "runtime_version": runtime_version,
           "input_shapes": graph.input_shapes(), "input_dtypes": [str(x.dtype) for x in graph.example]}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return Entry(os.path.join(root(), f"{runtime}-{graph.name}-{digest}"), key)


def _whole(entry: Entry) -> bool:
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(entry.folder, KEY_FILE)) as fh:
            return json.load(fh) == entry.key and os.path.exists(os.path.join(entry.folder, MODEL_FILE))
    return False


@contextlib.contextmanager
def one_at_a_time(job: str) -> Iterator[None]:
    """Hold this host's turn at `job` (a name for one conversion, check or measurement): an exclusive flock on a
    file of the cache's `locks/` folder, released when the block ends or its process dies (kill -9 included). A
    turn held past TURN_WAIT_S is passed by with a warning; a cache that cannot hold a lock runs the job as is.
    Not re-entrant: a process never asks for a job's turn while it holds that job's."""
    if fcntl is None:
        yield
        return
    try:
        folder = os.path.join(root(), "locks")
        os.makedirs(folder, exist_ok=True)
        handle = open(os.path.join(folder, hashlib.sha256(job.encode()).hexdigest()[:24] + ".lock"), "a")
    except OSError:
        yield
        return
    with handle:
        deadline = time.monotonic() + TURN_WAIT_S
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    logging.getLogger("imgest").warning("%s: another process has held it for %g s; done here "
                                                        "too", job, TURN_WAIT_S)
                    break
                time.sleep(0.1)
        yield  # the lock goes with the handle


def ensure(entry: Entry, convert: Callable[[str], None]) -> str:
    """The entry's model file, converted by `convert(folder)` first if the cache does not hold it whole (by one
    process of the host at a time: a second one waits and reads the first's)."""
    if not _whole(entry):
        with one_at_a_time(f"convert {entry.folder}"):
            return _ensure(entry, convert)
    return os.path.join(entry.folder, MODEL_FILE)


def _ensure(entry: Entry, convert: Callable[[str], None]) -> str:
    if not _whole(entry):
        os.makedirs(os.path.dirname(entry.folder), exist_ok=True)
        tmp = f"{entry.folder}.tmp-{uuid.uuid4().hex}"
        os.makedirs(tmp)
        try:
            convert(tmp)
            with open(os.path.join(tmp, KEY_FILE), "w") as fh:
                json.dump(entry.key, fh, indent=1, sort_keys=True)
            if os.path.isdir(entry.folder) and not _whole(entry):
                shutil.rmtree(entry.folder, ignore_errors=True)  # a folder under this name that is not whole
            try:
                os.rename(tmp, entry.folder)
            except OSError:  # another process put its whole entry there first: keep that one
                if not _whole(entry):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return os.path.join(entry.folder, MODEL_FILE)


def discard(entry: Entry) -> bool:
    """Remove a cached entry the runtime could not load (damaged on disk); False when there was none."""
    if not os.path.isdir(entry.folder):
        return False
    shutil.rmtree(entry.folder, ignore_errors=True)
    return True


def blob_dir(entry: Entry) -> str:
    """Where the runtime keeps its own compiled blobs for this entry (OpenVINO's CACHE_DIR)."""
    folder = os.path.join(entry.folder, "blobs")
    os.makedirs(folder, exist_ok=True)
    return folder


def read_record(entry: Entry, name: str) -> dict | None:
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(entry.folder, name)) as fh:
            record = json.load(fh)
            return record if isinstance(record, dict) else None
    return None


def write_record(entry: Entry, name: str, record: dict) -> None:
    os.makedirs(entry.folder, exist_ok=True)
    tmp = os.path.join(entry.folder, f".{name}.{uuid.uuid4().hex}")
    with open(tmp, "w") as fh:
        json.dump(record, fh, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(entry.folder, name))
