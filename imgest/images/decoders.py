"""JPEG decoders that scale in the DCT domain (Pillow's draft, simplejpeg, PyTurboJPEG), and the fastest one measured.

Decoding a product photo is mostly entropy decoding and the inverse DCT; libjpeg-turbo can do the latter at any
scale M/8, so a 1200 px photo needed at 256 px decodes at 3/8 of its side. Pillow's `draft` offers only 1/2, 1/4
and 1/8 (so the same photo decodes at 1/2); simplejpeg and PyTurboJPEG reach libjpeg-turbo's eighths. Which one
a run uses is measured on its own images (`fastest`), since the order depends on the CPU and the wheels; the
optional ones are only tried when installed (PyTurboJPEG also needs the system's libturbojpeg), and a missing
one is never an error. Each decodes only what it was made for (a plain colour or greyscale JPEG); anything else,
or any error, goes to Pillow, which then decides whether the object is an image at all. The last choice for a
model is kept beside its state (`state/model=<slug>/decoder.json`) so that its queries decode the same way.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

PILLOW = "pillow"


class Decoder(Protocol):
    name: str

    def missing(self) -> str | None:
        """Why this decoder cannot run here (a package or a library not installed), or None."""

    def scaled(self, data: bytes, size: tuple[int, int], min_side: int | None) -> np.ndarray:
        """A JPEG of `size` (width, height) decoded to RGB uint8 (H, W, 3) at the smallest DCT scale whose shorter
        side is at least `min_side` (the full image without it); raises on anything it cannot decode."""


def _eighths(size: tuple[int, int], min_side: int | None) -> tuple[int, int]:
    """The smallest scale n/8 (n in 1..8) keeping the shorter side at least `min_side`, as (n, 8)."""
    if not min_side:
        return 8, 8
    shorter = min(size)
    return next((n, 8) for n in range(1, 9) if -(-shorter * n // 8) >= min_side or n == 8)


class SimpleJpeg:
    """simplejpeg (libjpeg-turbo bundled in its wheel): it picks the smallest of libjpeg-turbo's scales that keeps
    both asked sides."""

    name = "simplejpeg"

    def missing(self) -> str | None:
        try:
            import simplejpeg  # noqa: F401
        except ImportError as exc:
            return f"the simplejpeg package is not installed ({exc})"
        return None

    def scaled(self, data: bytes, size: tuple[int, int], min_side: int | None) -> np.ndarray:
        import simplejpeg

        if not min_side:
            return simplejpeg.decode_jpeg(data, "RGB")
        width, height = size  # only the shorter side is held at min_side; the longer follows the aspect ratio
        return simplejpeg.decode_jpeg(data, "RGB", min_height=min_side if height <= width else 0,
                                      min_width=min_side if width < height else 0)


class TurboJpeg:
    """PyTurboJPEG over the system's libturbojpeg (Debian: libturbojpeg0), scaled by one of its factors."""

    name = "turbojpeg"

    def missing(self) -> str | None:
        try:
            _turbo()
        except ImportError as exc:
            return f"the PyTurboJPEG package is not installed ({exc})"
        except (OSError, RuntimeError) as exc:  # the package is there, the library it loads is not
            return f"PyTurboJPEG cannot load libturbojpeg ({str(exc).splitlines()[0][:160]})"
        return None

    def scaled(self, data: bytes, size: tuple[int, int], min_side: int | None) -> np.ndarray:
        from turbojpeg import TJPF_RGB

        turbo = _turbo()
        return turbo.decode(data, pixel_format=TJPF_RGB, scaling_factor=_eighths(size, min_side), flags=0)


@functools.lru_cache(maxsize=1)
def _turbo():
    from turbojpeg import TurboJPEG

    return TurboJPEG()


REGISTRY: dict[str, Decoder | None] = {PILLOW: None, SimpleJpeg.name: SimpleJpeg(), TurboJpeg.name: TurboJpeg()}


def get(name: str) -> Decoder | None:
    """The decoder registered as `name` (None for Pillow, which decode_image runs itself)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown JPEG decoder {name!r}; known: {', '.join(REGISTRY)}")
    return REGISTRY[name]


@functools.lru_cache(maxsize=1)
def installed() -> tuple[str, ...]:
    """The decoders that run here, Pillow first."""
    return tuple(name for name, decoder in REGISTRY.items() if decoder is None or decoder.missing() is None)


def fastest(datas: Sequence[bytes], work: Callable[[bytes, str], object],
            names: Sequence[str] | None = None, rounds: int = 2) -> tuple[str, dict[str, float]]:
    """The decoder that makes `work(data, decoder)` (decode and preprocess) cheapest in CPU time over `datas`, and
    each one's core-seconds per image (the better of `rounds`, taken in turn, so a moment of other work on the
    machine does not decide it). Pillow wins ties and is the answer without a sample."""
    names = [n for n in (names or installed()) if n in installed()] or [PILLOW]
    if not datas:
        return PILLOW, {}
    costs = {name: float("inf") for name in names}
    for _ in range(rounds):
        for name in names:
            start = time.thread_time()
            for data in datas:
                work(data, name)
            costs[name] = min(costs[name], (time.thread_time() - start) / len(datas))
    best = min(names, key=lambda n: (round(costs[n], 6), n != PILLOW))
    return best, {name: round(cost, 6) for name, cost in costs.items()}


def record_key(slug: str) -> str:
    from imgest.state.committed import state_prefix

    return f"{state_prefix(slug)}/decoder.json"


def record(store, slug: str, decoder: str, run_id: str) -> bool:
    """Keep the decoder a run encoded `slug`'s images with, for its queries (`recorded`). Written after the run's
    commit and only advice to its queries: a store that refuses it costs a warning (queries then decode with
    Pillow, as before any record), never the committed run."""
    import logging

    from imgest.storage import StorageError

    try:
        store.write_json(record_key(slug), {"decoder": decoder, "run_id": run_id})
    except (StorageError, OSError) as exc:
        logging.getLogger("imgest").warning("%s not written (%s): queries decode with Pillow", record_key(slug), exc)
        return False
    return True


def recorded(store, slug: str) -> str:
    """The decoder `slug`'s images were last decoded with, when it is one installed here; else Pillow. The record
    is read from the store: it can only name a registered decoder, never anything to load."""
    import logging

    from imgest.storage import RecordError, StorageError

    try:
        name = store.read_json(record_key(slug)).get("decoder") if store.exists(record_key(slug)) else None
    except (RecordError, StorageError, OSError, ValueError, AttributeError) as exc:
        logging.getLogger("imgest").warning("%s: not read (%s): queries decode with Pillow", record_key(slug), exc)
        return PILLOW
    return name if isinstance(name, str) and name in installed() else PILLOW
