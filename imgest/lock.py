"""One writer per store, fenced: a lock taken by exclusive create of a numbered generation, renewed by a
heartbeat, and checked at every commit point, so a holder that lost the lock cannot commit over its successor.

  locks/writer/<generation>.json   {token, owner, host, pid, started, heartbeat} (or {released: true, ...})

The holder is the highest generation. Taking the lock is creating the next one with an exclusive create
(O_EXCL on a disk, `If-None-Match: *` on S3: tested on moto's S3 server), which exactly one of several
racing writers wins; the previous generation may be taken over only when it was released or is stale
(same host and a dead pid, or no heartbeat for `ttl` seconds; an empty or unreadable lock file is judged
by its modification time). A holder that was paused (SIGSTOP, a long GC, a frozen VM) past `ttl` finds a
higher generation at its next commit point and stops with LockLostError: its late work is never made visible.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from imgest.storage import Location

LOCK_DIR = "locks/writer"
LOCK_WAIT_S = 600.0  # short writes (a window record, an evaluation) wait this long for a running writer
_GENERATION = re.compile(r"^(\d{12})\.json$")


class StoreLockedError(RuntimeError):
    """Another run holds the store; the message says which and since when."""


class LockLostError(RuntimeError):
    """This run no longer holds the store's writer lock: it stops before its next commit, changing nothing."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def generation_key(generation: int) -> str:
    return f"{LOCK_DIR}/{generation:012d}.json"


def generations(store: Location) -> list[int]:
    return sorted(int(m.group(1)) for name in store.list_names(LOCK_DIR) if (m := _GENERATION.match(name)))


def read_holder(store: Location, generation: int) -> dict | None:
    """The lock file's content, or None when it is empty or unreadable (a create killed half-way)."""
    try:
        holder = json.loads(store.read_bytes(generation_key(generation)))
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        return None
    return holder if isinstance(holder, dict) else None


def current_holder(store: Location) -> dict | None:
    """Who holds the store now (for `imgest status`), or None."""
    gens = generations(store)
    holder = read_holder(store, gens[-1]) if gens else None
    return None if holder is None or holder.get("released") else {**holder, "generation": gens[-1]}


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
            newer = read_holder(store, top) if top is not None else None
            by = f"generation {top} ({(newer or {}).get('owner', 'unknown')})" if top != self.generation else "nobody"
            raise LockLostError(f"store {store.url}: this run lost the writer lock (generation {self.generation}; it "
                                f"is now held by {by}), probably after a pause longer than the heartbeat window; "
                                "it stopped before its next commit and made nothing of its own visible")


class StoreLock:
    """Context manager. Stale means: holder on this host with a dead pid, or no heartbeat for ``ttl`` s."""

    def __init__(self, store: Location, owner: str, ttl: float | None = None, heartbeat: float | None = None,
                 wait: float = 0.0):
        # IMGEST_LOCK_TTL (seconds, default 300): how long a silent holder keeps the store; it beats ten times
        # per window. Shorter means faster take-over of a dead writer, and more LIST/PUT calls per hour.
        self.ttl = float(ttl if ttl is not None else os.environ.get("IMGEST_LOCK_TTL", 300))
        self.heartbeat = float(heartbeat if heartbeat is not None else self.ttl / 10)
        self.store, self.owner, self.wait = store, owner, wait
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fence: Fence | None = None
        self.lost = False

    def _payload(self, **extra) -> bytes:
        return json.dumps({
            "token": self.fence.token if self.fence else self._token, "owner": self.owner,
            "host": socket.gethostname(), "pid": os.getpid(), "heartbeat": time.time(), "started": self._started,
            **extra,
        }).encode()

    def _is_stale(self, holder: dict | None, generation: int) -> bool:
        if holder is None:  # empty or unreadable: judge by when it was last written
            mtime = self.store.modified(generation_key(generation))
            return mtime is None or time.time() - mtime > self.ttl
        if holder.get("released"):
            return True
        if holder.get("host") == socket.gethostname() and not _pid_alive(int(holder.get("pid", -1))):
            return True
        return time.time() - float(holder.get("heartbeat", 0)) > self.ttl

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
        self._started = datetime.now(UTC).isoformat(timespec="seconds")
        self._token = secrets.token_hex(16)
        for _ in range(5):
            gens = generations(self.store)
            top = gens[-1] if gens else 0
            if top:
                holder = read_holder(self.store, top)
                if not self._is_stale(holder, top):
                    who = (f"run {holder.get('owner')} (host {holder.get('host')}, pid {holder.get('pid')}, started "
                           f"{holder.get('started')})" if holder is not None else
                           f"a writer whose lock file {generation_key(top)} is still being written (or empty; "
                           f"taken over {self.ttl:.0f} s after it was written)")
                    raise StoreLockedError(f"store {self.store.url} is locked by {who}: another ingest, index build "
                                           "or migration step is running; wait for it to finish")
            # exactly one of several racing writers creates the next generation
            if self.store.create_exclusive(generation_key(top + 1), self._payload()):
                self.fence = Fence(self.store.url, top + 1, self._token)
                for old in gens:  # superseded generations: their holders find out at their next check
                    self.store.delete(generation_key(old))
                self._thread = threading.Thread(target=self._beat, name="imgest-lock-heartbeat", daemon=True)
                self._thread.start()
                return self.fence
        raise StoreLockedError(f"store {self.store.url}: another writer took the lock at the same moment; try again")

    def check(self) -> None:
        if self.fence is None:
            raise LockLostError("the writer lock was never taken")
        self.fence.check(self.store)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            try:
                self.check()  # never renew a generation that is no longer ours
                self.store.write_bytes(generation_key(self.fence.generation), self._payload())
            except LockLostError:
                self.lost = True
                return
            except Exception:  # a missed heartbeat only risks a stale verdict later; keep running
                pass

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
