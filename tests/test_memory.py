"""A flow gives what a step freed back to the system before the next step: Arrow's pool keeps freed pages that
glibc's trim does not reach (here: strings made and dropped in a worker thread, as a shard task does)."""

from __future__ import annotations

import subprocess
import sys

import pytest

STEP = """
import gc, numpy as np, pyarrow as pa
from concurrent.futures import ThreadPoolExecutor
from imgest.memory import give_back

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20

def step(i):  # a task in the flow's worker thread: Arrow strings made and dropped
    held = [pa.array(np.random.rand(100_000)).cast(pa.string()) for _ in range(80)]  # ~200 MB at once
    return sum(len(a) for a in held)

before = rss()
with ThreadPoolExecutor(1) as pool:
    list(pool.map(step, range(4)))
gc.collect()
freed = rss()
give_back()
print(before, freed, rss())
"""


@pytest.mark.slow("a subprocess")
def test_memory_a_step_freed_goes_back_to_the_system():
    before, freed, after = map(int, subprocess.run([sys.executable, "-c", STEP], check=True, capture_output=True,
                                                   text=True).stdout.split())
    assert freed - before > 100, (before, freed)  # Arrow's pool kept the freed strings...
    assert after - before < 0.25 * (freed - before), (before, freed, after)  # ...until given back
