"""Shadow traffic: a share of the live queries `serving` answers is run again on the migration window's
candidate (`shadow`), off the request path, and recorded in the store (imgest/state/shadow.py).

The request thread only draws the share and puts the query on a bounded queue (full: the query is dropped and
counted, never waited for). One worker thread runs the queued queries on its own following searcher of
`shadow`, measures overlap@k with what was served and its latency, and writes the rows as a create-only part
every `flush_rows` rows or `flush_every_s` seconds, and at close. Rows still in memory when the process is killed
are lost: they are samples, and a part is written whole or not at all.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from imgest.redact import one_line
from imgest.retrieval.following import Answer, FollowingSearcher
from imgest.retrieval.query import Query
from imgest.state.shadow import overlap, write_part
from imgest.state.window import read_window
from imgest.storage import open_location
from imgest.timing import Stopwatch


@dataclass
class _Served:
    queries: list[Query]
    k: int
    options: dict
    items: list[str]
    serving: str
    served_ms: float
    at: str


def _kind(query: Query) -> str:
    return "item" if query.item_id is not None else "text" if query.text is not None else "image"


class ShadowTraffic:
    def __init__(self, store_url: str, share: float, device: str = "auto", flush_rows: int = 500,
                 flush_every_s: float = 60.0, check_every_s: float = 5.0, queue_size: int = 256,
                 clock: Callable[[], float] = time.monotonic, seed: int | None = None):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"shadow share must be between 0 and 1, got {share}")
        self.store = open_location(store_url, must_exist=True, what="store")
        self.share, self.flush_rows, self.flush_every_s, self.check_every_s = share, flush_rows, flush_every_s, \
            check_every_s
        self.candidate = FollowingSearcher(store_url, ("shadow",), device=device)
        self.window: dict | None = None  # the open window while shadow traffic applies
        self.made_by = f"imgest api on {socket.gethostname()} (pid {os.getpid()}), shadow share {share}"
        self.recorded = self.dropped = self.failed = 0
        self._queue: queue.Queue[_Served] = queue.Queue(maxsize=queue_size)
        self._rows: list[dict] = []
        self._clock, self._rng = clock, random.Random(seed)
        self._flushed_at = self._checked_at = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> None:
        """Follow the window and the candidate: shadow traffic applies while a window is open (until finish,
        through a rollback) and `shadow` serves the window's new model; `offer` takes only queries the old model
        answered as `serving`."""
        window = read_window(self.store)
        if self.window is not None and (window is None or window["id"] != self.window["id"]):
            self.flush()  # rows belong to the window they were measured in
        if window is not None:
            self.candidate.refresh()
            status = self.candidate.status()["shadow"]
            if status["model"] != window["to"]["slug"]:
                window = None
        self.window = window
        self._checked_at = self._clock()

    def offer(self, queries: list[Query], k: int, options: dict, answer: Answer, served_ms: float) -> bool:
        """Called by the request after it is answered; never blocks. True when the query was queued."""
        window = self.window
        if window is None or list(answer.served) != ["serving"] or answer.model != window["from"]["slug"]:
            return False
        if self._rng.random() >= self.share:
            return False
        served = _Served(queries, k, options, [h.item_id for h in answer.hits[0]],
                         f"model={answer.model} v{answer.version}", served_ms,
                         datetime.now(UTC).isoformat(timespec="milliseconds"))
        try:
            self._queue.put_nowait(served)
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def run_one(self, served: _Served) -> dict:
        """One queued query on the candidate, as a record row."""
        row = {"at": served.at, "kind": _kind(served.queries[0]), "k": served.k, "serving": served.serving,
               "served_ms": round(served.served_ms, 3), "overlap": None, "shadow_ms": None, "shadow": None,
               "error": None}
        took = Stopwatch()
        try:
            answer = self.candidate.search(served.queries, served.k, **served.options)
        except Exception as exc:  # noqa: BLE001 - the candidate's failure is what shadow traffic is for: recorded
            row["error"], self.failed = one_line(exc)[:500], self.failed + 1
            return row
        row.update(shadow_ms=round(1000 * took.elapsed, 3),
                   shadow=f"model={answer.model} v{answer.version}",
                   overlap=overlap(served.items, [h.item_id for h in answer.hits[0]]))
        return row

    def step(self, wait: float = 0.5) -> None:
        """Run at most one queued query, then check and flush when due (the worker's loop body)."""
        try:
            served = self._queue.get(timeout=wait)
        except queue.Empty:
            served = None
        if served is not None and self.window is not None:
            self._rows.append(self.run_one(served))
            self.recorded += 1
        now = self._clock()
        if len(self._rows) >= self.flush_rows or (self._rows and now - self._flushed_at >= self.flush_every_s):
            self.flush()
        if now - self._checked_at >= self.check_every_s:
            self.check()

    def flush(self) -> None:
        rows, window = self._rows, self.window
        self._rows, self._flushed_at = [], self._clock()
        if rows and window is not None:
            try:
                write_part(self.store, window["id"], rows, self.made_by)
            except Exception as exc:  # noqa: BLE001 - a store outage loses these samples, never a request
                logging.getLogger("imgest").warning("shadow traffic: %d rows not written: %s", len(rows),
                                                    one_line(exc))

    def start(self) -> None:
        self.check()

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.step()
                except Exception as exc:  # noqa: BLE001 - shadow traffic never stops the service
                    logging.getLogger("imgest").warning("shadow traffic: %s", one_line(exc))
                    self._stop.wait(self.check_every_s)

        self._thread = threading.Thread(target=loop, name="imgest-shadow-traffic", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.flush()
