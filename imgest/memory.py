"""Give a long flow's freed memory back to the system between its steps; torch's large tensors on huge pages.

A flow process runs step after step in one Python process; what a step frees (Arrow buffers, a faiss index, the
objects of a reply) goes back to glibc's heap, which keeps most of it mapped: the next step then starts from
the high-water mark of the last. Dask's workers trim for the same reason (`distributed`'s memory trim). Arrow's
buffers come from its own pool (mimalloc in pyarrow's wheels), which keeps freed pages from glibc's trim:
measured, 1.2 GB of freed strings stayed resident through `malloc_trim` and went with the pool's
`release_unused()`."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os

TORCH_HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None  # glibc only


def give_back() -> None:
    """Collect unreachable cycles, then return free pages: Arrow's pool's, and the heap's (glibc `malloc_trim`;
    elsewhere a no-op)."""
    import pyarrow as pa

    gc.collect()
    pa.default_memory_pool().release_unused()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def prefer_huge_pages() -> None:
    """torch's CPU tensors of 2 MB and more on transparent huge pages, unless the environment says otherwise.

    Eager torch allocates a forward pass's activations afresh at every batch (tens of MB each, mapped and
    unmapped by glibc), and the kernel faults them in 4 KB at a time: Lite0-GeM at batch 32 on one core, 14.1
    img/s with 6 million page faults for 256 photos, most of its time the kernel's; on huge pages 27.5 img/s and
    0.16 million (BENCHMARKS.md, "Eager torch on huge pages"). torch reads its switch once, at its first
    allocation, so this runs before torch is imported (`import imgest` does it). OpenVINO keeps its buffers
    between requests and is not affected."""
    os.environ.setdefault(TORCH_HUGE_PAGES, "1")
