"""IVF codes added once every inverted list's length is known.

A faiss IVF list is a growing array: filled a block at a time, the lists end up holding about twice their entries'
bytes (measured 1.8x at 2M vectors of d = 48, SQ8), and that slack is most of what a large build holds beyond its
index. So the blocks are encoded as they pass, with faiss's standalone codes (the list number, then the code: what
`add` would store), and written with their ids to a scratch file on local disk; the lists are then sized once and
the codes added back from the file. The file is read and written with plain I/O, so it sits in the page cache, not
in this process's memory. Indexes whose lists are not plain arrays (fast-scan blocks) are filled as before."""

from __future__ import annotations

import os

import numpy as np

from imgest.scratch import scratch_folder

READ_ROWS = 65_536  # codes read back from the file per add


def _array_lists(index):
    import faiss

    ivf = faiss.extract_index_ivf(index)
    lists = faiss.downcast_InvertedLists(ivf.invlists)
    return ivf, (lists if isinstance(lists, faiss.ArrayInvertedLists) else None)


def list_numbers(codes: np.ndarray, width: int) -> np.ndarray:
    """The list number at the head of each standalone code (`width` bytes, little-endian)."""
    head = codes[:, :width].astype(np.int64)
    return np.bitwise_or.reduce(head << (8 * np.arange(width, dtype=np.int64)), axis=1)


class SizedAdd:
    """`add(vectors, ids)` block by block, then `fill()` once: the index holds every code, each list allocated once
    at its final length."""

    def __init__(self, index) -> None:
        self.index = index
        self.ivf, self.lists = _array_lists(index)
        if self.lists is None:
            return
        self.code = index.sa_code_size()
        self.record = 8 + self.code  # the faiss id, then the code
        self.counts = np.zeros(self.ivf.nlist, np.int64)
        self.path = os.path.join(scratch_folder(self, "codes"), "codes.bin")
        self.file = open(self.path, "wb")

    def add(self, vectors: np.ndarray, ids: np.ndarray) -> None:
        if self.lists is None:
            self.index.add_with_ids(vectors, ids)
            return
        codes = self.index.sa_encode(np.ascontiguousarray(vectors, np.float32))
        self.counts += np.bincount(list_numbers(codes, self.ivf.coarse_code_size()), minlength=len(self.counts))
        records = np.empty((len(ids), self.record), np.uint8)
        records[:, :8] = np.ascontiguousarray(ids, "<i8").view(np.uint8).reshape(-1, 8)
        records[:, 8:] = codes
        records.tofile(self.file)

    def fill(self):
        """Size every list, add the codes back from the file, remove it; returns the index."""
        if self.lists is None:
            return self.index
        self.file.close()
        for number in np.flatnonzero(self.counts):  # a vector shrunk keeps its capacity: allocated once, exactly
            self.lists.resize(int(number), int(self.counts[number]))
            self.lists.resize(int(number), 0)
        with open(self.path, "rb") as file:
            while len(records := np.fromfile(file, np.uint8, READ_ROWS * self.record)):
                records = records.reshape(-1, self.record)
                ids = np.ascontiguousarray(records[:, :8]).view("<i8").ravel()
                self.ivf.add_sa_codes(np.ascontiguousarray(records[:, 8:]), ids)
        os.remove(self.path)
        self.index.ntotal = self.ivf.ntotal  # an OPQ rotation's wrapper counts what its IVF holds
        return self.index
