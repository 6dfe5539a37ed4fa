"""Progress for a person: a rich progress bar on a terminal, plain lines elsewhere; flows report to it.

The command line installs a reporter around a flow it runs in its own process (`reporting()`); a flow
run by a worker or a deployment has none and reports through its Prefect progress artifact only.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time
from collections.abc import Callable, Iterator

Reporter = Callable[[str, int, int, str], None]  # (what, done, in total, unit: images or vectors)
PLAIN_EVERY = 10.0  # seconds between plain lines of one count (a 10M-row sync reported 10,000 lines to its log)
_reporter: contextvars.ContextVar[Reporter | None] = contextvars.ContextVar("imgest_progress", default=None)


def report(what: str, done: int, total: int, unit: str = "images") -> None:
    """Tell the person watching, if any: `what` (e.g. the model), `unit` done of total."""
    reporter = _reporter.get()
    if reporter is not None:
        reporter(what, done, total, unit)


@contextlib.contextmanager
def reporting(stream=None) -> Iterator[None]:
    """Within it, report() draws a live bar (count, rate, ETA) when `stream` is a terminal, else writes
    plain lines: the first and the last of each count, and at most one every PLAIN_EVERY seconds between."""
    stream = stream or sys.stderr
    if stream.isatty():
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[unit]}"), TaskProgressColumn(), TextColumn("{task.fields[rate]}"),
                   TimeElapsedColumn(),
                   TextColumn("ETA"), TimeRemainingColumn())
        with Progress(*columns, console=Console(file=stream), transient=False) as bar:
            tasks: dict[str, int] = {}

            def draw(what: str, done: int, total: int, unit: str) -> None:
                if what not in tasks:
                    tasks[what] = bar.add_task(what, total=total, rate="-", unit=unit)
                task = bar.tasks[tasks[what]]
                rate = f"{done / task.elapsed:.1f} {_per_second(unit)}" if task.elapsed else "-"
                bar.update(tasks[what], completed=done, total=total, rate=rate)

            token = _reporter.set(draw)
            try:
                yield
            finally:
                _reporter.reset(token)
        return
    started: dict[str, float] = {}
    written: dict[str, float] = {}

    def line(what: str, done: int, total: int, unit: str) -> None:
        now = time.monotonic()
        start = started.setdefault(what, now)
        if what in written and done < total and now - written[what] < PLAIN_EVERY:
            return
        written[what] = now
        elapsed = now - start
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = f", about {(total - done) / rate / 60:.1f} min left" if rate and done < total else ""
        print(f"{what}: {done:,}/{total:,} {unit}, {rate:.1f} {_per_second(unit)}{eta}", file=stream, flush=True)

    token = _reporter.set(line)
    try:
        yield
    finally:
        _reporter.reset(token)


def _per_second(unit: str) -> str:
    return "img/s" if unit == "images" else f"{unit}/s"
