"""Re-rank vectors on local disk: a PQ index's float16 vectors (faiss IndexRefine) written to its file a block
at a time and read back memory-mapped, so that neither a build nor an update holds them in RAM (at 100M x 1280
they are 256 GB; the PQ codes searched beside them are a few GB)."""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterable

import numpy as np

from imgest.retrieval.mapped import open_mapped

# The last bytes faiss writes for an IndexRefine over an IndexScalarQuantizer: the re-rank codes as a
# length-prefixed byte vector (uint64 length, then the codes), then IndexRefine's k_factor (float32).
TAIL = struct.Struct("<Qf")
BLOCK = 65_536  # rows encoded or copied at a time


class RerankError(RuntimeError):
    """The re-rank vectors cannot be written on disk (an index type imgest does not build that way)."""


def on_disk(refine) -> bool:
    """The re-rank codes are a view of a mapped file (read with faiss.IO_FLAG_MMAP_IFC), not owned in RAM."""
    import faiss

    vectors = faiss.downcast_index(refine.refine_index)
    return isinstance(vectors, faiss.IndexFlatCodes) and not vectors.codes.is_owned


def _codes_index(refine):
    import faiss

    vectors = faiss.downcast_index(refine.refine_index)
    if not isinstance(vectors, faiss.IndexFlatCodes):
        raise RerankError(f"re-rank vectors of type {type(vectors).__name__} cannot be renumbered")
    return vectors


def codes_view(refine) -> np.ndarray:
    """The re-rank codes as a read-only (rows, code_size) array over faiss's own buffer (mapped or owned)."""
    import faiss

    vectors = _codes_index(refine)
    flat = faiss.rev_swig_ptr(vectors.codes.data(), vectors.codes.size()) if vectors.codes.size() else \
        np.empty(0, np.uint8)
    view = flat.reshape(-1, vectors.code_size)
    view.flags.writeable = False
    return view


def _encoder(refine):
    """The re-rank index when its file layout is the one `write_mapped` splices (a byte vector of codes)."""
    import faiss

    vectors = faiss.downcast_index(refine.refine_index)
    if not isinstance(vectors, faiss.IndexScalarQuantizer):
        raise RerankError(f"re-rank vectors of type {type(vectors).__name__} are kept in RAM; imgest writes "
                          "IndexScalarQuantizer ones to disk")
    return vectors


def emptied(refine):
    """A new IndexRefine over `refine`'s base (shared) with an empty re-rank store quantized as `refine`'s: what
    `write_mapped` fills. `refine`'s own codes are not copied (clone_index would read them all into RAM)."""
    import faiss

    vectors = _encoder(refine)
    empty = faiss.IndexScalarQuantizer(vectors.d, vectors.sq.qtype, vectors.metric_type)
    empty.sq, empty.is_trained = vectors.sq, vectors.is_trained
    empty.ntotal = refine.base_index.ntotal  # IndexRefine's constructor checks the counts agree (no codes yet)
    out = faiss.IndexRefine(refine.base_index, empty)
    out.k_factor = refine.k_factor
    return out


def encoded_blocks(refine, vectors: np.ndarray) -> Iterable[np.ndarray]:
    """The re-rank codes of `vectors` (float32, a memory map), BLOCK rows at a time."""
    encoder, block = _encoder(refine), BLOCK
    for begin in range(0, len(vectors), block):
        yield encoder.sa_encode(np.ascontiguousarray(vectors[begin:begin + block], np.float32))


def renumbered_blocks(refine, remap: np.ndarray, rows: int, added_ids: np.ndarray,
                      added: np.ndarray) -> Iterable[np.ndarray]:
    """The codes in the new id order, BLOCK new rows at a time: a kept row's codes copied from its old row
    (`remap`: old id -> new id, -1 gone), an added row's encoded from `added` (its new id in `added_ids`)."""
    encoder, block = _codes_index(refine), BLOCK
    old = codes_view(refine)
    source = np.full(rows, -1, np.int64)  # new id -> old row, or -(1 + position in `added`)
    kept = np.flatnonzero(remap >= 0)
    source[remap[kept]] = kept
    source[added_ids] = -1 - np.arange(len(added_ids))
    for begin in range(0, rows, block):
        wanted = source[begin:begin + block]
        out = np.empty((len(wanted), encoder.code_size), np.uint8)
        copy = wanted >= 0
        out[copy] = old[wanted[copy]]
        if not copy.all():
            at = -1 - wanted[~copy]
            out[~copy] = encoder.sa_encode(np.ascontiguousarray(added[at], np.float32))
        yield out


def add_on_disk(index, vectors: np.ndarray, on_added: Callable[[int], None] | None = None):
    """Fill a trained, empty IndexRefine from `vectors` (a memory map, faiss id order): the PQ codes added in
    RAM, the re-rank codes encoded into its file; returns the index read back with them mapped."""
    from imgest.retrieval.params import refine_of
    from imgest.tasks.index.build import add_in_blocks

    refine = refine_of(index)
    add_in_blocks(refine.base_index, vectors, on_added=on_added)
    return write_mapped(refine, len(vectors), encoded_blocks(refine, vectors))


def write_mapped(refine, rows: int, blocks: Iterable[np.ndarray], folder: str | None = None):
    """The IndexRefine `refine` (its base holding `rows` vectors, its re-rank index trained and empty) written to
    a file with the codes from `blocks` (in faiss id order), and read back with them memory-mapped; its base
    (PQ codes, searched and updated) copied to RAM. The file is unlinked once mapped: the mapping keeps it.

    faiss cannot stream a vector it does not hold, so it writes the index with an empty re-rank store whose
    count is already `rows`, and the codes go in place of the empty vector at its end (TAIL); the file is then
    byte for byte what faiss writes for the same index in RAM (tested), and read by faiss itself."""
    import faiss

    encoder = _encoder(refine)
    nbytes = rows * encoder.code_size
    folder = tempfile.mkdtemp(prefix="imgest-rerank-", dir=folder)
    path = os.path.join(folder, "index.faiss")
    try:
        encoder.ntotal = refine.ntotal = rows
        try:
            faiss.write_index(refine, path)
        finally:
            encoder.ntotal = 0
        with open(path, "r+b") as fh:
            fh.seek(-TAIL.size, os.SEEK_END)
            length, k_factor = TAIL.unpack(fh.read(TAIL.size))
            if length != 0:
                raise RerankError(f"faiss wrote {length} bytes of re-rank codes for an empty store")
            fh.seek(-TAIL.size, os.SEEK_END)
            fh.write(struct.pack("<Q", nbytes))
            written = 0
            for codes in blocks:
                fh.write(np.ascontiguousarray(codes, np.uint8).tobytes())
                written += codes.nbytes
            if written != nbytes:
                raise RerankError(f"{written} bytes of re-rank codes written for {rows} rows ({nbytes} bytes)")
            fh.write(struct.pack("<f", k_factor))
        return open_mapped(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
