"""Decoded pixels from decode processes to the encoder through shared memory, not pickles through a pipe.

The encoder's process owns one shared-memory block of fixed-size slots, one per image in flight. It gives
each object a slot by its place in the shard; the decode process writes the preprocessed pixels into that
slot and returns only their shape and dtype; the encoder copies them out as it takes the object, and the
slot comes round again once the read-ahead has moved past it. An object retried after its decode process
died writes its slot again. The block is unlinked when the shard ends, and by Python's resource tracker if
the encoder's process is killed.
"""

from __future__ import annotations

import functools
import os
from multiprocessing import shared_memory

import numpy as np

from imgest.errors import FinalError, UserError

SHM = "/dev/shm"  # where Linux keeps shared-memory blocks; a container's is 64 MB unless its runtime sizes it
SHM_MARGIN = 1.25  # the room asked beyond the slots themselves: another shard's block, the allocator's pages


class SharedMemoryError(UserError, FinalError):
    """/dev/shm cannot hold the decode processes' pixel slots: writing past it would kill them with SIGBUS."""


def room(path: str = SHM) -> int | None:
    """Bytes free in the shared-memory filesystem at `path`; None where there is none to check (not Linux)."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def check_room(count: int, nbytes: int, path: str = SHM, free: int | None = None) -> None:
    """SharedMemoryError, one line with the fix, when `count` slots of `nbytes` (and the margin) do not fit in
    what `path` has free (`free`, where the caller measured it). Checked before a run encodes anything and before
    each shard's block is made."""
    free = room(path) if free is None else free
    need = int(count * nbytes * SHM_MARGIN)
    if free is not None and free < need:
        raise SharedMemoryError(
            f"{path} has {free / 2**20:.0f} MB free; the decode processes' pixel slots need {need / 2**20:.0f} MB "
            f"({count} images of {nbytes / 1024:.0f} kB in flight): give the container a larger {path} (docker run "
            "--shm-size 2g; Kubernetes: the job template's memory-backed /dev/shm, docs/operations.md), or lower "
            "--batch-size")


class PixelSlots:
    """`count` slots of `nbytes` each, named so a decode process can attach by name. The n-th object of a
    shard goes to slot n % count: with `count` one more than the read-ahead's depth, no slot is written again
    before the encoder has copied it out (tasks/ingest/decode_workers.py `read_ahead`)."""

    def __init__(self, count: int, nbytes: int):
        self.count, self.nbytes = count, nbytes
        self._shm = shared_memory.SharedMemory(create=True, size=max(1, count * nbytes))
        self.name = self._shm.name

    @property
    def address(self) -> tuple[str, int, int]:
        """What a decode process needs to write into the block: its name, slot count and slot size."""
        return self.name, self.count, self.nbytes

    def read(self, slot: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        view = np.ndarray(shape, np.dtype(dtype), buffer=self._shm.buf, offset=slot * self.nbytes)
        return view.copy()

    def close(self) -> None:
        self._shm.close()
        self._shm.unlink()


@functools.lru_cache(maxsize=4)
def _attached(name: str) -> shared_memory.SharedMemory:
    """In a decode process: the encoder's block, attached once."""
    return shared_memory.SharedMemory(name=name)


def write(name: str, slot: int, nbytes: int, pixels: np.ndarray) -> bool:
    """In a decode process: `pixels` into their slot; False when they do not fit (they travel as they are)."""
    pixels = np.ascontiguousarray(pixels)
    if pixels.nbytes > nbytes:
        return False
    target = np.ndarray(pixels.shape, pixels.dtype, buffer=_attached(name).buf, offset=slot * nbytes)
    target[...] = pixels
    return True


def slot_bytes(encoder) -> int:
    """The size of one preprocessed image of `encoder` (a probe through its own preprocessing)."""
    from PIL import Image

    return int(np.asarray(encoder.preprocess(Image.new("RGB", (320, 240), "white"))).nbytes)
