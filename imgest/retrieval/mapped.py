"""A version's IndexRefine file opened with its re-rank vectors memory-mapped, not read into RAM (at 100M x 1280
they are 256 GB; the PQ codes searched beside them are a few GB)."""

from __future__ import annotations


def open_mapped(path: str, io_flags: int | None = None):
    """An IndexRefine file read with its re-rank codes mapped (faiss.IO_FLAG_MMAP_IFC, or `io_flags`) and its
    base copied to RAM (owned by the index: writable, freed with it)."""
    import faiss

    index = faiss.read_index(path, faiss.IO_FLAG_MMAP_IFC if io_flags is None else io_flags)
    inner = faiss.downcast_index(index)
    mapped = inner.base_index
    inner.own_fields = False
    mapped.thisown = True  # the mapped base is Python's to free (after the swap)
    # a serialised round trip owns its copy of the base; clone_index would keep viewing the mapping
    base = faiss.deserialize_index(faiss.serialize_index(mapped))
    base.thisown = False
    inner.base_index, inner.own_fields = base, True
    return index
