"""Give a long flow's freed memory back to the system between its steps.

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
