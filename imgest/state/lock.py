"""One writer per store, fenced: a lock taken by exclusive create of a numbered generation, renewed by a
heartbeat, and checked at every commit point, so a holder that lost the lock cannot commit over its successor.

  locks/writer/<generation>.json   {token, owner, host, pid, started, heartbeat} (or {released: true, ...})

The holder is the highest generation. Taking the lock is creating the next one with an exclusive create
(O_EXCL on a disk, `If-None-Match: *` on S3: tested on moto's S3 server and SeaweedFS), which exactly one of several
racing writers wins; the previous generation may be taken over only when it was released or is stale
(same host and a dead pid, or no heartbeat for `ttl` seconds). A lock file that is empty, not JSON, or whose
fields are not what imgest writes (a text pid, a heartbeat that is no time) is judged by its modification
time: stale `ttl` seconds after it was last written. A holder that was paused (SIGSTOP, a long GC, a frozen
VM) past `ttl` finds a higher generation at its next commit point and stops with LockLostError.

A fence check and the write after it are two steps, and a writer can pause between them. Records replaced in
place (aliases, the migration window) are therefore committed by `fenced_write`: the writer keeps the version
token of the record it read, checks its fence, then writes only if the record is still that version, so a
successor's write of the record is never overwritten.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from imgest.errors import UserError
from imgest.state.layout import LOCK_DIR, generation_key
from imgest.storage import Location

LOCK_WAIT_S = 600.0  # short writes (a window record, an evaluation) wait this long for a running writer
_GENERATION = re.compile(r"^(\d{12})\.json$")
_MAX_PID = 2**31 - 1  # what kill(2) takes: a larger number names no process
_MAX_LOCK_BYTES = 1 << 16  # a lock file is a few hundred bytes; a longer one is read cut off, so malformed


class StoreLockedError(UserError, RuntimeError):
    """Another run holds the store; the message says which and since when."""


class LockLostError(UserError, RuntimeError):
    """This run no longer holds the store's writer lock: it stops before its next commit, changing nothing."""


class RecordChangedError(LockLostError):
    """A record this run read was replaced before this run's write of it: the write did not happen."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _text(value: str) -> str:
    return value if len(value) <= 80 else f"{value[:77]}..."


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")


def run_owner(action: str) -> str:
    """The owner a run takes the lock as, which `imgest status` and a refused run show: `<action>@<host>:<pid>`."""
    return f"{action}@{socket.gethostname()}:{os.getpid()}"


def generations(store: Location) -> list[int]:
    return sorted(int(m.group(1)) for name in store.list_names(LOCK_DIR) if (m := _GENERATION.match(name)))


def read_holder(store: Location, generation: int) -> dict | None:
    """The lock file's content, or None when it is empty, unreadable or not a JSON object (a create killed
    half-way, or a file imgest did not write)."""
    try:
        holder = json.loads(store.read_bytes(generation_key(generation), limit=_MAX_LOCK_BYTES))
    except (FileNotFoundError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    return holder if isinstance(holder, dict) else None


def default_ttl() -> float:
    # IMGEST_LOCK_TTL (seconds, default 300): how long a silent holder keeps the store; it beats ten times per
    # window. Shorter means faster take-over of a dead writer, and more LIST/PUT calls per hour.
    return float(os.environ.get("IMGEST_LOCK_TTL", 300))


def malformed(holder: dict, now: float, ttl: float) -> str | None:
    """What is wrong with a lock file's fields (one phrase), or None when they are the ones imgest writes. A
    heartbeat more than `ttl` ahead of `now` is garbage too (it would keep the store locked for ever)."""
    released = holder.get("released", False)
    if not isinstance(released, bool):
        return f"field 'released' must be true or false, got {_show(released)}"
    for name in ("token", "owner", "host", "started"):
        if not isinstance(holder.get(name), str) or not holder[name]:
            return f"field {name!r} must be a non-empty string, got {_show(holder.get(name))}"
    pid = holder.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid <= _MAX_PID:
        return f"field 'pid' must be a process id (1 to {_MAX_PID}), got {_show(pid)}"
    beat = holder.get("heartbeat")
    if isinstance(beat, bool) or not isinstance(beat, int | float) or not math.isfinite(beat) or beat < 0:
        return f"field 'heartbeat' must be a time in seconds since 1970, got {_show(beat)}"
    if beat > now + ttl:
        return f"field 'heartbeat' is {beat - now:.0f} s in the future"
    return None


def current_holder(store: Location, now: float | None = None) -> dict | None:
    """Who holds the store now (for `imgest status`), or None. Always has owner, host, pid and started; a lock
    file that is empty or malformed is reported as such (under `malformed`), never as an error."""
    gens = generations(store)
    if not gens:
        return None
    holder = read_holder(store, gens[-1])
    if holder is not None and holder.get("released") is True:
        return None
    now = time.time() if now is None else now
    problem = "empty or not a JSON object" if holder is None else malformed(holder, now, default_ttl())
    if problem is None:
        return {**holder, "generation": gens[-1]}
    host, pid = (holder or {}).get("host"), (holder or {}).get("pid")
    mtime = store.modified(generation_key(gens[-1]))
    return {"owner": f"unknown (malformed lock file {generation_key(gens[-1])}: {problem})", "generation": gens[-1],
            "host": _text(host) if isinstance(host, str) else None,
            "pid": pid if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid <= _MAX_PID else None,
            "started": _iso(mtime) if mtime is not None else None, "malformed": problem}


@dataclass(frozen=True)
class Fence:
    """The proof a writer checks before each commit: its store and generation. Picklable, so it travels to
    encode tasks on other processes and machines with the store URL."""

    store_url: str
    generation: int
    token: str

    def check(self, store: Location | None = None) -> None:
        """Raise LockLostError unless this generation is still the store's highest and still ours."""
        store = store or Location(self.store_url)
        gens = generations(store)
        top = gens[-1] if gens else None
        holder = read_holder(store, self.generation) if top == self.generation else None
        if top != self.generation or holder is None or holder.get("token") != self.token or holder.get("released"):
            newer = read_holder(store, top) if top is not None and top != self.generation else None
            owner = (newer or {}).get("owner", "unknown")
            by = f"generation {top} ({_text(owner) if isinstance(owner, str) else _show(owner)})" \
                if top != self.generation else "nobody"
            raise LockLostError(f"store {store.url}: this run lost the writer lock (generation {self.generation}; it "
                                f"is now held by {by}), probably after a pause longer than the heartbeat window; "
                                "it stopped before its next commit and made nothing of its own visible")


def fenced_write(store: Location, key: str, record: Any, token: str | None, fence: Fence | None) -> str:
    """Commit a JSON record replaced in place: check the fence, then write only if ``key`` is still the version
    this run read (`token` from `Location.read_versioned`; None: it did not exist). A writer paused between the
    check and the write finds the record changed by its successor and writes nothing (RecordChangedError, a
    LockLostError). Returns the new version token."""
    if fence is not None:
        fence.check(store)
    new = store.write_json_if(key, record, token)
    if new is None:
        raise _changed(store, key, fence)
    return new


def fenced_delete(store: Location, key: str, token: str, fence: Fence | None) -> None:
    """Delete a record as `fenced_write` writes one: only if it is still the version this run read."""
    if fence is not None:
        fence.check(store)
    if not store.delete_if(key, token):
        raise _changed(store, key, fence)


def _changed(store: Location, key: str, fence: Fence | None) -> RecordChangedError:
    what = f"{key} was changed by another writer after this run read it, so this run's write of it did not happen"
    if fence is not None:
        try:
            fence.check(store)
        except LockLostError as lost:
            return RecordChangedError(f"{lost}; {what}")
    return RecordChangedError(f"store {store.url}: {what} (the other writer had lost the writer lock, or took "
                              "none); run the step again")


class StoreLock:
    """Context manager. Stale means: holder on this host with a dead pid, or no heartbeat for ``ttl`` s. A
    malformed lock file is stale once not written for ``ttl`` s, unless it names a live process on this host.
    ``clock`` gives the time written as the heartbeat and judged against others' (tests move it instead of
    sleeping, and beat with `renew`); ``heartbeat`` is the real interval of the heartbeat thread."""

    def __init__(self, store: Location, owner: str, ttl: float | None = None, heartbeat: float | None = None,
                 wait: float = 0.0, clock: Callable[[], float] = time.time):
        self.ttl = float(ttl if ttl is not None else default_ttl())
        self.heartbeat = float(heartbeat if heartbeat is not None else self.ttl / 10)
        self.store, self.owner, self.wait, self.clock = store, owner, wait, clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fence: Fence | None = None
        self.lost = False

    def _payload(self, **extra) -> bytes:
        return json.dumps({
            "token": self.fence.token if self.fence else self._token, "owner": self.owner,
            "host": socket.gethostname(), "pid": os.getpid(), "heartbeat": self.clock(), "started": self._started,
            **extra,
        }).encode()

    def _holds(self, holder: dict | None, generation: int) -> str | None:
        """Who holds the store through this generation (for StoreLockedError), or None when it may be taken over."""
        if holder is not None and holder.get("released") is True:
            return None
        now = self.clock()
        problem = "empty or not a JSON object" if holder is None else malformed(holder, now, self.ttl)
        if problem is None:
            if holder["host"] == socket.gethostname() and not _pid_alive(holder["pid"]):
                return None
            if now - holder["heartbeat"] > self.ttl:
                return None
            return (f"run {_text(holder['owner'])} (host {_text(holder['host'])}, pid {holder['pid']}, started "
                    f"{_text(holder['started'])})")
        key = generation_key(generation)
        host, pid = (holder or {}).get("host"), (holder or {}).get("pid")
        if host == socket.gethostname() and isinstance(pid, int) and not isinstance(pid, bool) \
                and 0 < pid <= _MAX_PID and _pid_alive(pid):
            return (f"a process alive on this host (pid {pid}) whose lock file {key} is malformed ({problem}); it "
                    "is not taken over while that process runs: stop it, or delete the file if it is not imgest")
        mtime = self.store.modified(key)  # judged by when it was last written, like a file never finished
        if mtime is None or now - mtime > self.ttl:
            return None
        return (f"a writer whose lock file {key} is still being written, or is malformed ({problem}); it was last "
                f"written at {_iso(mtime)} and is taken over {self.ttl:.0f} s after that, at "
                f"{_iso(mtime + self.ttl)} (in {mtime + self.ttl - now:.0f} s), unless its holder rewrites it")

    def acquire(self) -> Fence:
        """Take the lock, or raise StoreLockedError (after polling for `wait` seconds, when given)."""
        deadline = time.monotonic() + self.wait
        while True:
            try:
                return self._acquire()
            except StoreLockedError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(min(2.0, max(0.1, deadline - time.monotonic())))

    def _acquire(self) -> Fence:
        self._started = datetime.fromtimestamp(self.clock(), UTC).isoformat(timespec="seconds")
        self._token = secrets.token_hex(16)
        for _ in range(5):
            gens = generations(self.store)
            top = gens[-1] if gens else 0
            if top and (who := self._holds(read_holder(self.store, top), top)):
                raise StoreLockedError(f"store {self.store.url} is locked by {who}: another ingest, index build "
                                       "or migration step is running; wait for it to finish")
            # exactly one of several racing writers creates the next generation
            if self.store.create_exclusive(generation_key(top + 1), self._payload()):
                self.fence = Fence(self.store.url, top + 1, self._token)
                # Superseded generations go, all but the one just taken over: a writer listing at this moment
                # must still see a generation, or it would find none and create generation 1 again.
                for old in gens[:-1]:
                    self.store.delete(generation_key(old))
                self._thread = threading.Thread(target=self._beat, name="imgest-lock-heartbeat", daemon=True)
                self._thread.start()
                return self.fence
        raise StoreLockedError(f"store {self.store.url}: another writer took the lock at the same moment; try again")

    def check(self) -> None:
        if self.fence is None:
            raise LockLostError("the writer lock was never taken")
        self.fence.check(self.store)

    def renew(self) -> bool:
        """One heartbeat, as the heartbeat thread beats every `heartbeat` seconds: the lock file rewritten with
        the clock's time. False (and `lost` set) once this generation is no longer ours, which is never renewed;
        a write that fails is let go (it only risks a stale verdict later). Tests call it after moving the clock."""
        try:
            self.check()  # never renew a generation that is no longer ours
            self.store.write_bytes(generation_key(self.fence.generation), self._payload())
        except LockLostError:
            self.lost = True
            return False
        except Exception:  # a missed heartbeat only risks a stale verdict later; keep running
            pass
        return True

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            if not self.renew():
                return

    def release(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        if self.fence is None:
            return
        try:
            self.check()
        except LockLostError:
            return  # a successor holds it: leave its lock alone
        self.store.write_bytes(generation_key(self.fence.generation), self._payload(released=True))

    def __enter__(self) -> StoreLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
