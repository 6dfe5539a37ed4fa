"""JPEG decoders (Pillow's draft, simplejpeg, PyTurboJPEG scale in the DCT domain; nvJPEG decodes on a GPU), and the
decode a model's vectors were made with (its decoder and decode side), recorded in its store.

Decoding a product photo is mostly entropy decoding and the inverse DCT; libjpeg-turbo can do the latter at any
scale M/8, so a 1200 px photo needed at 256 px decodes at 3/8 of its side. Pillow's `draft` offers only 1/2, 1/4
and 1/8 (so the same photo decodes at 1/2); simplejpeg and PyTurboJPEG reach libjpeg-turbo's eighths. The
optional ones only run when installed (PyTurboJPEG also needs the system's libturbojpeg), and a missing one is
never an error until a store says a model was decoded by it. Each decodes only what it was made for (a plain
colour or greyscale JPEG); anything else, or any error, goes to Pillow, which then decides whether the object is
an image at all.

The decoders' pixels differ (scale, filters, rounding), and so do the embeddings made from them: the decoder is
part of what made a vector, and so is the side it decodes down to. Both follow from the model, never from a
timing: every model decodes with DEFAULT (simplejpeg, a dependency of every install, so every host has it; it
measured cheapest of the three on product photos in each benchmark run, BENCHMARKS.md) down to its
preprocessing's side (`encoder.decode_side`), so two stores of the same catalogue and model hold the same
vectors. Both are recorded beside the model's state before its first shard (`state/model=<slug>/decoder.json`,
`create_record`) and kept by every later run, resume and query; another decoder is taken only by an explicit
choice that passes the gate against the recorded one. A record is read from a store: it can only name a
registered decoder, never anything to load.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

import numpy as np

from imgest.errors import UserError
from imgest.state.layout import decoder_key

PILLOW = "pillow"
NVJPEG = "nvjpeg"
DEFAULT = "simplejpeg"  # every model's decoder unless its store recorded another (see the module doc)


class DecoderError(UserError, ValueError):
    """A run cannot decode as its model's vectors were decoded, or a decoder asked for cannot be used; the message
    says which decoder made the vectors and how to go on."""


class Decoder(Protocol):
    name: str
    gpu: bool  # decodes on a GPU, batched by the encoder's thread (tasks/ingest/gpu_decode.py): never timed

    def missing(self) -> str | None:
        """Why this decoder cannot run here (a package or a library not installed), or None."""

    def scaled(self, data: bytes, size: tuple[int, int], min_side: int | None) -> np.ndarray:
        """A JPEG of `size` (width, height) decoded to RGB uint8 (H, W, 3) at the smallest DCT scale whose shorter
        side is at least `min_side` (the full image without it); raises on anything it cannot decode."""


def eighths(size: tuple[int, int], min_side: int | None) -> tuple[int, int]:
    """The smallest scale n/8 (n in 1..8) keeping the shorter side at least `min_side`, as (n, 8)."""
    if not min_side:
        return 8, 8
    shorter = min(size)
    return next((n, 8) for n in range(1, 9) if -(-shorter * n // 8) >= min_side or n == 8)


class SimpleJpeg:
    """simplejpeg (libjpeg-turbo bundled in its wheel): it picks the smallest of libjpeg-turbo's scales that keeps
    both asked sides."""

    name = "simplejpeg"
    gpu = False

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
    gpu = False

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
        return turbo.decode(data, pixel_format=TJPF_RGB, scaling_factor=eighths(size, min_side), flags=0)


@functools.lru_cache(maxsize=1)
def _turbo():
    from turbojpeg import TurboJPEG

    return TurboJPEG()


class NvJpeg:
    """nvJPEG through torchvision (`imgest[gpu]`) on a CUDA device. nvJPEG decodes whole images only: each is
    reduced on the GPU to the eighths libjpeg-turbo's scaled decode keeps (`tensors.dct_scaled`, in the DCT
    domain as libjpeg does), so a model decoded down to its side reads pixels within the decoder gate of the CPU
    decoders'. An ingest on CUDA decodes a batch of plain JPEGs in one call and does the rest on the GPU
    (BatchJpegDecoder); a query, and the gate, decode one here. Never timed against the CPU decoders: a model uses
    it only where its store records it or a run chooses it (--decoder nvjpeg), past the gate."""

    name = NVJPEG
    gpu = True

    def missing(self) -> str | None:
        try:
            import torch
            from torchvision.io import decode_jpeg  # noqa: F401
        except ImportError as exc:
            return f"torchvision is not installed ({exc}; pip install 'imgest[gpu]')"
        except (OSError, RuntimeError) as exc:  # torchvision's image library did not load
            return f"torchvision's image decoder did not load ({str(exc).splitlines()[0][:160]})"
        return None if torch.cuda.is_available() else "no CUDA device here"

    def scaled(self, data: bytes, size: tuple[int, int], min_side: int | None) -> np.ndarray:
        import torch
        from torchvision.io import ImageReadMode, decode_jpeg

        from imgest.images.tensors import dct_scaled

        image = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB,
                            device="cuda")  # EXIF orientation: decode_image applies it, as for the others
        return dct_scaled(image, eighths(size, min_side)[0]).permute(1, 2, 0).cpu().numpy()


REGISTRY: dict[str, Decoder | None] = {PILLOW: None, SimpleJpeg.name: SimpleJpeg(), TurboJpeg.name: TurboJpeg(),
                                       NvJpeg.name: NvJpeg()}  # imgest.names.DECODERS


def get(name: str) -> Decoder | None:
    """The decoder registered as `name` (None for Pillow, which decode_image runs itself)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown JPEG decoder {name!r}; known: {', '.join(REGISTRY)}")
    return REGISTRY[name]


@functools.lru_cache(maxsize=1)
def installed() -> tuple[str, ...]:
    """The decoders that run here, Pillow first."""
    return tuple(name for name, decoder in REGISTRY.items() if decoder is None or decoder.missing() is None)


def timed() -> tuple[str, ...]:
    """The decoders a model's first run times against each other: those installed here that decode on the CPU."""
    return tuple(name for name in installed() if REGISTRY[name] is None or not REGISTRY[name].gpu)


def unusable(name: str, device: str) -> str | None:
    """Why `name` cannot decode a run's JPEGs here on `device` (not installed, or a GPU decoder off CUDA), or None."""
    decoder = get(name)
    if decoder is None:
        return None
    if decoder.gpu and not str(device).startswith("cuda"):
        return f"it decodes on the GPU and this run's encoder is on {device}"
    return decoder.missing()


def fastest(datas: Sequence[bytes], work: Callable[[bytes, str], object],
            names: Sequence[str] | None = None, rounds: int = 2) -> tuple[str, dict[str, float]]:
    """The decoder that makes `work(data, decoder)` (decode and preprocess) cheapest in CPU time over `datas`, and
    each one's core-seconds per image, the better of `rounds` taken in turn, so a moment of other work on the
    machine does not decide it: a measurement for benchmarks and a run's cost, never what picks a model's decoder;
    `names` defaults to the CPU decoders installed (`timed`). Pillow wins ties and is the answer without a sample."""
    names = [n for n in (names or timed()) if n in installed()] or [PILLOW]
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


DEFAULTED = "default"  # the model's first run in the store: DEFAULT, at the model's decode side
MEASURED = "measured"  # timed on the model's first run in the store (records made before the decoder was fixed)
EXPLICIT = "explicit"  # a run chose it (--decoder): the first in the store, or past the gate against the one before
FORCED = "forced"  # a run chose it past the gate, or where the gate could not be measured; the reason is kept
ASSUMED = "assumed"  # vectors made before decoders were recorded: Pillow's, the only decoder there was
EARLIER = "recorded after a run"  # a record written the old way, after a run's commit: its choice all the same
INHERITED = "inherited"  # the decoder of the model whose kept pixels it read (records made before the decoder was
# fixed)
HOW = (DEFAULTED, MEASURED, EXPLICIT, FORCED, ASSUMED, EARLIER, INHERITED)
FULL = 0  # a record's side: JPEGs decoded whole
UNRECORDED = -1  # a record's side: written before sides were recorded (the model's decode then: `legacy_side`)
MAX_SIDE = 1 << 15


def legacy_side(encoder) -> int:
    """The side a model's JPEGs were decoded down to before decode sides were recorded: its preprocessing's side,
    except where the encoder says its decode was full then (`legacy_decode_side`: transformers models, whose side
    was not read from their processors). Without an encoder: the whole image."""
    side = getattr(encoder, "legacy_decode_side", getattr(encoder, "decode_side", None))
    return int(side or FULL)


@dataclass(frozen=True)
class Decode:
    """How a model's JPEGs are decoded: by `decoder`, down to a shorter side of `side` (None: the whole image);
    imgest/images/decode.py `decode_as` decodes so."""

    decoder: str = PILLOW
    side: int | None = None

    def describe(self) -> str:
        return f"{self.decoder}, {f'down to a shorter side of {self.side} px' if self.side else 'full size'}"


def min_side(encoder, side: int | None = None) -> int | None:
    """A decode side as `decode_image` takes it: `side` (a recorded one; FULL: the whole image, None), or without
    one the encoder's own preprocessing side."""
    return (getattr(encoder, "decode_side", None) if side is None else side) or None


def default_decode(encoder) -> Decode:
    """The decode a model's first run in a store records: DEFAULT down to its preprocessing's side (or the whole
    image, where a gated side fails its gate: tasks/ingest/decoder.py)."""
    return Decode(DEFAULT, min_side(encoder))


@dataclass(frozen=True)
class Record:
    """A model's JPEG decode in a store: the decoder and the decode side its vectors are made with, how they were
    chosen and by which run; on a switch, the decoder before and the gate's figures against it (or the reason it was
    forced); on a first run of a model whose side is gated, the side gate's figures (`side_gate`)."""

    decoder: str
    how: str
    run_id: str = ""
    created: str = ""
    measured: dict[str, float] = field(default_factory=dict)  # records from before: each decoder timed
    previous: str | None = None
    gate: dict | None = None
    side: int = UNRECORDED  # the shorter side JPEGs decode down to; FULL: the whole image
    side_gate: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def decode(self, encoder) -> Decode:
        """The decode this record says, for `encoder` (which resolves a side from before sides were recorded)."""
        side = legacy_side(encoder) if self.side == UNRECORDED else self.side
        return Decode(self.decoder, side or None)

    def describe(self) -> str:
        """One phrase: "simplejpeg (measured, run r00000001-...), down to 224 px"."""
        by = f", run {self.run_id}" if self.run_id else ""
        after = f", after {self.previous}" if self.previous else ""
        side = "" if self.side == UNRECORDED else ", full size" if self.side == FULL else \
            f", down to a shorter side of {self.side} px"
        return f"{self.decoder} ({self.how}{by}{after}){side}"


def parse_record(value: object) -> Record:
    """A record read from a store, trusted for its registered decoder name and plain figures only; ValueError
    naming what is wrong otherwise (a garbled or planted record is never half-used)."""
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    name = value.get("decoder")
    if not isinstance(name, str) or name not in REGISTRY:
        raise ValueError(f"decoder {str(name)[:40]!r} is not a registered one ({', '.join(REGISTRY)})")
    how = value.get("how", EARLIER)
    run_id, created, previous = (value.get(k) for k in ("run_id", "created", "previous"))
    measured = value.get("measured") or {}
    gate, side_gate = value.get("gate"), value.get("side_gate")
    side = value.get("side", UNRECORDED)

    def plain(text: object) -> bool:
        return isinstance(text, str) and len(text) <= 200 and text.isprintable()

    if how not in HOW or not all(v is None or plain(v) for v in (run_id, created)) \
            or not (previous is None or previous in REGISTRY) \
            or not (isinstance(measured, dict) and all(k in REGISTRY and type(v) in (int, float)
                                                       for k, v in measured.items())) \
            or not all(figures is None or isinstance(figures, dict) and len(figures) <= 16 and all(
                plain(k) and (type(v) in (int, float, bool) or plain(v)) for k, v in figures.items())
                for figures in (gate, side_gate)) \
            or not (type(side) is int and (side in (FULL, UNRECORDED) or 0 < side <= MAX_SIDE)):
        raise ValueError("a field is not what a decoder record holds (how, run_id, created, measured, previous, "
                         "gate, side, side_gate)")
    return Record(name, how, run_id or "", created or "", dict(measured), previous, gate, side, side_gate)


def read_record(store, slug: str) -> Record | None:
    """The model's decoder record in `store`, None where there is none; a DecoderError naming the file when it does
    not read as one. A store that cannot be reached raises its own error (StorageError): the run stops on the
    store's failure, not on the record's."""
    from imgest.storage import RecordError

    key = decoder_key(slug)
    try:
        if not store.exists(key):
            return None
        return parse_record(store.read_json(key))
    except FileNotFoundError:
        return None
    except (RecordError, ValueError) as exc:
        raise DecoderError(f"{key} does not read as a decoder record ({str(exc).splitlines()[0][:200]})") from None


def create_record(store, slug: str, record: Record) -> Record:
    """Record `record` as the model's decoder unless a record exists: the store's exclusive create, so two first
    runs at once agree (the one that loses reads and returns the winner's)."""
    import json

    if store.create_exclusive(decoder_key(slug), json.dumps(record.to_dict(), indent=2).encode()):
        return record
    kept = read_record(store, slug)
    if kept is None:  # removed between the two calls: nothing to agree with
        raise DecoderError(f"{decoder_key(slug)} was created and removed at once; run again")
    return kept


def replace_record(store, slug: str, record: Record, fence=None) -> None:
    """Switch the model's decoder (an explicit choice that passed the gate, or was forced): only by the run that
    holds the store's lock."""
    if fence is not None:
        fence.check(store)
    store.write_json(decoder_key(slug), record.to_dict())


def check(store, slug: str, asked: str | None, force: str | None, device: str) -> Record | None:
    """What can be known before any work: the model's record, when this run can decode as it says or was told
    explicitly how to go on; else a DecoderError in one line, saying which decoder made the vectors and what to
    do. An explicit decoder other than the recorded one is checked here for what it needs (installed, the gate
    measurable: the recorded decoder here too, unless forced); the gate itself runs with the encoder."""
    try:
        record = read_record(store, slug)
    except DecoderError as exc:
        if asked is not None and force:
            return None  # replaced by the forced choice: nothing of it is used
        raise DecoderError(f"{exc}: it says which JPEG decoder made the vectors of model={slug}; pass --decoder "
                           "NAME --force-decoder REASON to record one again") from None
    if asked is not None:
        if why := unusable(asked, device):
            raise DecoderError(f"--decoder {asked} cannot decode here: {why}")
        if record is not None and asked != record.decoder and not force \
                and (why := unusable(record.decoder, device)):
            raise DecoderError(f"--decoder {asked}: the vectors of model={slug} were made with JPEGs decoded by "
                               f"{record.decoder}, which cannot run here to measure the gate ({why}): install it, "
                               "or switch without the gate with --force-decoder REASON")
        return record
    if record is not None and (why := unusable(record.decoder, device)):
        raise DecoderError(f"the vectors of model={slug} in this store were made with JPEGs decoded by "
                           f"{record.decoder}, which cannot run here ({why}): install it (or run where it is), or "
                           "switch the model to another decoder with --decoder NAME (gated against it) or "
                           "--decoder NAME --force-decoder REASON")
    return record


def recorded(store, slug: str, encoder=None) -> Decode:
    """How `slug`'s images were decoded, for its queries (its side resolved by `encoder`; without one, a side from
    before sides were recorded reads as the full image), when its decoder can run here; else Pillow's, with a
    warning. The record is read from the store: it can only name a registered decoder, never anything to load."""
    from imgest.storage import StorageError

    fallback = Decode(PILLOW, legacy_side(encoder) or None)
    try:
        record = read_record(store, slug)
    except (DecoderError, StorageError, OSError) as exc:
        logging.getLogger("imgest").warning("%s: queries decode with Pillow", exc)
        return fallback
    if record is None:
        return fallback  # vectors from before decoders were recorded: Pillow's
    if record.decoder not in installed():
        logging.getLogger("imgest").warning("model=%s: its images were decoded by %s, not installed here: queries "
                                            "decode with Pillow", slug, record.decoder)
        return Decode(PILLOW, record.decode(encoder).side)
    return record.decode(encoder)
