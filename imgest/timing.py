"""Timing a stage: one stopwatch for every figure of seconds imgest records or logs (autofaiss's Timeit)."""

from __future__ import annotations

import time
from collections.abc import Callable


class Stopwatch:
    """Seconds on a clock (injectable, so tests move it instead of sleeping).

    Running from creation: ``total = Stopwatch()`` ... ``total.seconds``. As a context manager it times its
    block, and summed over several blocks when entered again: ``encoding = Stopwatch(running=False)``, then
    ``with encoding: ...`` in a loop."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, running: bool = True):
        self._clock = clock
        self._total = 0.0
        self._since = clock() if running else None

    def __enter__(self) -> Stopwatch:
        self._since = self._clock()
        return self

    def __exit__(self, *exc) -> None:
        self._total += self._clock() - self._since
        self._since = None

    @property
    def elapsed(self) -> float:
        """Seconds so far: the blocks timed, plus the one running now."""
        return self._total + (self._clock() - self._since if self._since is not None else 0.0)

    @property
    def seconds(self) -> float:
        """`elapsed` to the millisecond, as cards, summaries and logs record it."""
        return round(self.elapsed, 3)


def projected_hours(corpus_size: int, images_per_second: float) -> float:
    """Hours to encode `corpus_size` images at `images_per_second`: corpus_size / rate / 3600, to 4 significant
    digits (small projections too). The figure of `report cost` and of `eval --candidates`."""
    return float(f"{corpus_size / images_per_second / 3600:.4g}")
