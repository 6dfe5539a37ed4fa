"""One writer per store: an exclusive-create lock object with a heartbeat, broken only when stale."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import UTC, datetime

from imgest.storage import Location

LOCK_KEY = "locks/writer.lock"


class StoreLockedError(RuntimeError):
    """Another run holds the store; the message says which and since when."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class StoreLock:
    """Context manager. Stale means: holder on this host with a dead pid, or no heartbeat for ``ttl`` s."""

    def __init__(self, store: Location, owner: str, ttl: float = 300.0, heartbeat: float = 30.0):
        self.store, self.owner, self.ttl, self.heartbeat = store, owner, ttl, heartbeat
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.broke: dict | None = None

    def _payload(self) -> bytes:
        return json.dumps({
            "owner": self.owner, "host": socket.gethostname(), "pid": os.getpid(),
            "heartbeat": time.time(), "started": self._started,
        }).encode()

    def _is_stale(self, holder: dict) -> bool:
        if holder.get("host") == socket.gethostname() and not _pid_alive(int(holder.get("pid", -1))):
            return True
        return time.time() - float(holder.get("heartbeat", 0)) > self.ttl

    def acquire(self) -> None:
        self._started = datetime.now(UTC).isoformat(timespec="seconds")
        for _ in range(3):
            if self.store.create_exclusive(LOCK_KEY, self._payload()):
                self._thread = threading.Thread(target=self._beat, name="imgest-lock-heartbeat", daemon=True)
                self._thread.start()
                return
            try:
                holder = self.store.read_json(LOCK_KEY)
            except (FileNotFoundError, json.JSONDecodeError):
                continue  # released or being written between our two calls; try again
            if not self._is_stale(holder):
                raise StoreLockedError(
                    f"store {self.store.url} is locked by run {holder.get('owner')} (host {holder.get('host')}, "
                    f"pid {holder.get('pid')}, started {holder.get('started')}): another ingest, index build or "
                    "migration step is running; wait for it to finish"
                )
            self.broke = holder
            self.store.delete(LOCK_KEY)
        raise StoreLockedError(f"store {self.store.url}: could not take the lock after breaking a stale one")

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            try:
                self.store.write_bytes(LOCK_KEY, self._payload())
            except Exception:  # a missed heartbeat only risks a stale verdict later; keep running
                pass

    def release(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        try:
            holder = self.store.read_json(LOCK_KEY)
        except FileNotFoundError:
            return
        if holder.get("owner") == self.owner:
            self.store.delete(LOCK_KEY)

    def __enter__(self) -> StoreLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
