"""A flow gives what a step freed back to the system before the next step: Arrow's pool keeps freed pages that
glibc's trim does not reach (here: strings made and dropped in a worker thread, as a shard task does)."""

from __future__ import annotations

import os
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


HUGE = """
import imgest, torch
tensor = torch.ones(64 << 20, dtype=torch.uint8)  # a 64 MB activation's worth, every page touched
address = tensor.data_ptr()
huge_kb, inside = 0, False
for line in open("/proc/self/smaps"):
    if "-" in line.split(" ", 1)[0]:
        start, end = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
        inside = start <= address < end
    elif inside and line.startswith("AnonHugePages:"):
        huge_kb = int(line.split()[1])
print(huge_kb)
"""


def _huge_kb(**env: str) -> int:
    clean = {k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "GLIBC_TUNABLES")}
    return int(subprocess.run([sys.executable, "-c", HUGE], check=True, capture_output=True, text=True,
                              env={**clean, **env}).stdout)


@pytest.mark.slow("a subprocess")
def test_a_process_that_imports_imgest_puts_torchs_large_tensors_on_huge_pages():
    """Eager torch's activations are faulted in page by page otherwise (imgest/memory.py): half of its time on
    a CPU here. A user's own choice in the environment is kept."""
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
        if "[never]" in fh.read():
            pytest.skip("this kernel's transparent huge pages are off")
    assert _huge_kb() >= 32 << 10  # most of the 64 MB on 2 MB pages
    assert _huge_kb(THP_MEM_ALLOC_ENABLE="0") == 0
