"""Parity before use: a runtime and precision must encode a fixed sample as eager torch fp32 does, or not run.

fp32 on another runtime is the same arithmetic reordered: every input's two embeddings must agree to a cosine
of 0.99999. A reduced precision (bf16, fp16) is an approximation, like an index, and is judged by what it changes
in retrieval rather than by its worst single vector: over the sample, the mean cosine to torch fp32 >= 0.998,
the 1st percentile >= 0.99, and each image's 10 nearest neighbours within the sample (exact search) overlapping
its fp32 ones by >= 0.90 on average. The smallest cosine is recorded, not gated (one near-blank image can sit
far below the rest and change no ranking). A tower that keeps some layers in fp32 under a reduced precision
(runtimes.Split) is checked as it runs, and its record names those layers.

The sample is 256 product photos made from scikit-image's photos (`imgest.images.demo.product_photos`, seed 0: real
pictures at 800-2000 px, JPEG, every tenth a PNG cut-out on white), through the encoder's own preprocessing,
and, for a model with a text tower, a fixed list of product queries. The first check of a (model, runtime,
precision) on a host is kept beside its compiled model (imgest/encoders/compiled.py) and reused, and so are torch
fp32's embeddings of the sample: the reference of every later check of the model on that host.

A JPEG decoder is an approximation of the same kind (imgest/images/decoders.py): a model switches from the decoder
its store recorded to another only where the other passes the reduced precision's gate against it
(`decoder_parity`): the sample's files as stored (not thumbnailed: a decoder's scale depends on the size), each
decoded by both at the model's decode side and encoded by the run's encoder.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import socket
import uuid
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

import numpy as np

from imgest.encoders import compiled
from imgest.encoders.base import EncoderError

FP32_MIN_COSINE = 0.99999
REDUCED_MEAN_COSINE, REDUCED_P1_COSINE, REDUCED_OVERLAP = 0.998, 0.99, 0.90
OVERLAP_K = 10
SAMPLE_IMAGES, SAMPLE_SEED = 256, 0
SAMPLE_SIDE = 512  # the photos are kept at most this wide and high: above any model's input side
CHUNK = 16  # images encoded at a time
SAMPLE_TEXTS = ("a red leather ankle boot", "white sneakers on a wooden floor", "a cup of espresso",
                "a tabby cat", "stainless steel watch with a black strap", "a blue denim jacket",
                "astronaut portrait", "a rocket on the launch pad")
# the sample as records name it (a cache key and a stored field: the words stay as first recorded, though the photos'
# module now sits in imgest/images/demo.py)
SAMPLE = (f"{SAMPLE_IMAGES} product photos (imgest.demo.product_photos, seed {SAMPLE_SEED}) through the encoder's "
          f"preprocessing; {len(SAMPLE_TEXTS)} fixed texts for a text tower")
REFERENCE = "torch fp32"
PILLOW_FULL = "pillow at full size"  # a reduced decode's reference: what a transformers processor reads alone


class ParityError(EncoderError):
    """A runtime at a precision does not reproduce torch fp32 on the sample; the message gives the figures."""


def gate(precision: str) -> dict[str, float]:
    """The figures a precision must reach (see the module doc)."""
    if precision == "fp32":
        return {"min_cosine": FP32_MIN_COSINE}
    return {"mean_cosine": REDUCED_MEAN_COSINE, "p1_cosine": REDUCED_P1_COSINE,
            f"overlap@{OVERLAP_K}": REDUCED_OVERLAP}


class GateFigures:
    """What a parity check measured (`min_cosine`, `mean_cosine`, `p1_cosine`, `overlap`) against its `gate`."""

    def figures(self) -> dict[str, float]:
        return {"min_cosine": self.min_cosine, "mean_cosine": self.mean_cosine, "p1_cosine": self.p1_cosine,
                f"overlap@{OVERLAP_K}": self.overlap}

    def shortfalls(self) -> list[str]:
        """Each figure below what the gate needs, in words."""
        return [f"{name.replace('_', ' ')} {self.figures()[name]:.6g} below the {need} it needs"
                for name, need in self.gate.items() if self.figures()[name] < need]


@dataclass
class Parity(GateFigures):
    model_id: str
    runtime: str
    precision: str
    device: str
    min_cosine: float
    mean_cosine: float
    p1_cosine: float
    overlap: float  # mean share of each input's OVERLAP_K neighbours within the sample kept (1.0: same lists)
    gate: dict
    passed: bool
    kept_fp32: str  # the layers run in fp32 at this reduced precision ("" for none): runtimes.Split
    sample: str
    reference: str
    host: str
    created: str

    def reason(self) -> str:
        short = self.shortfalls()
        kept = f" ({self.kept_fp32} in fp32)" if self.kept_fp32 else ""
        return (f"{self.runtime} {self.precision}{kept} against {self.reference} on the parity sample: "
                + "; ".join(short or ["passed"]))

    def to_dict(self) -> dict:
        return asdict(self)


@functools.lru_cache(maxsize=2)
def _photos() -> tuple:
    """The sample's pictures, decoded upright in RGB (Pillow; the same pixels go to both sides)."""
    from PIL import Image, ImageOps

    images = []
    for data in _sample_files():
        image = Image.open(io.BytesIO(data))
        image.draft("RGB", (SAMPLE_SIDE, SAMPLE_SIDE))  # a JPEG decoded at a reduced DCT scale, never below it
        image = ImageOps.exif_transpose(image)
        image.thumbnail((SAMPLE_SIDE, SAMPLE_SIDE), Image.Resampling.BICUBIC)  # 256 full photos would hold ~1 GB
        if image.mode != "RGB":
            background = Image.new("RGBA", image.size, (255, 255, 255, 255))
            image = Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
        images.append(image)
    return tuple(images)


def sample_batch(encoder, which: slice = slice(None)) -> np.ndarray:
    """The sample's photos (or `which` of them) through `encoder`'s preprocessing (made once within `shared`)."""
    key = (encoder.spec.model_id, which.start, which.stop, which.step)
    batch = _shared_batches.get(key)
    if batch is None:
        batch = np.stack([encoder.preprocess(image) for image in _photos()[which]])
        if _sharing:
            _shared_batches[key] = batch
    return batch


_sharing: list[bool] = []  # one entry per `shared()` open
_shared_batches: dict[tuple, np.ndarray] = {}  # within `shared()`: (model id, slice) -> the preprocessed sample


@contextlib.contextmanager
def shared():
    """Within it, the checks of one model's candidates (a run's choice checks each runtime at each precision)
    preprocess the sample once instead of once each (about 6 s for Lite0 on one core); the batches (~150 MB for a
    224 px model) are let go at its end."""
    _sharing.append(True)
    try:
        yield
    finally:
        _sharing.pop()
        if not _sharing:
            _shared_batches.clear()


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)


def neighbour_overlap(reference: np.ndarray, candidate: np.ndarray, k: int = OVERLAP_K) -> float:
    """Mean over inputs of |N_ref(i) & N_cand(i)| / k, N(i) being i's k nearest others by cosine (exact)."""
    k = min(k, len(reference) - 1)
    if k < 1:
        return 1.0

    def lists(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float64)
        x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
        scores = x @ x.T
        np.fill_diagonal(scores, -np.inf)
        return np.argsort(-scores, axis=1, kind="stable")[:, :k]

    ours, theirs = lists(reference), lists(candidate)
    return float(np.mean([len(np.intersect1d(a, b)) / k for a, b in zip(ours, theirs)]))


def _in_chunks(encode, batch: np.ndarray, size: int = CHUNK) -> np.ndarray:
    """The sample encoded CHUNK images at a time: a network's activations for all 256 at once take gigabytes."""
    return np.concatenate([encode(batch[i:i + size]) for i in range(0, len(batch), size)])


# (model id, device, tower) -> torch fp32's embeddings of the sample: a run checks two or more candidates of one
# model (each runtime at each precision) against the same reference, computed once per process and kept in the
# compiled-model cache for the host's later checks (the sample and the model id fix it; eager torch fp32 over 256
# photos is most of a check's time).
_references: dict[tuple[str, str, str], np.ndarray] = {}
_KEPT_REFERENCES = 8


def _reference(reference, tower: str, encode) -> np.ndarray:
    key = (reference.spec.model_id, str(reference.device), tower)
    if key not in _references:
        while len(_references) >= _KEPT_REFERENCES:
            _references.pop(next(iter(_references)))
        path, rows = _reference_path(reference, tower), SAMPLE_IMAGES if tower == "image" else len(SAMPLE_TEXTS)
        kept = _read_reference(path, rows)
        if kept is None:
            with compiled.one_at_a_time(f"reference {path}"):  # a process checking another candidate waits
                kept = _read_reference(path, rows)
                if kept is None:
                    kept = np.asarray(encode(), np.float32)
                    _write_reference(path, kept)
        _references[key] = kept
    return _references[key]


def _reference_path(reference, tower: str) -> str:
    from imgest.encoders.base import device_key

    key = {"model_id": reference.spec.model_id, "tower": tower, "device": device_key(str(reference.device), False),
           "sample": SAMPLE, "reference": REFERENCE}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return os.path.join(compiled.root(), "references", f"{tower}-{digest}.npy")


def _read_reference(path: str, rows: int) -> np.ndarray | None:
    """The kept embeddings, if whole: a float32 matrix of the sample's rows (never a pickle)."""
    with contextlib.suppress(OSError, ValueError):
        kept = np.load(path, allow_pickle=False)
        if kept.dtype == np.float32 and kept.ndim == 2 and len(kept) == rows and np.isfinite(kept).all():
            return kept
    return None


def _write_reference(path: str, embeddings: np.ndarray) -> None:
    with contextlib.suppress(OSError):  # a cache that cannot be written costs the next check its time only
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex}.npy"
        np.save(tmp, embeddings, allow_pickle=False)
        os.replace(tmp, path)


def measure(reference, candidate) -> dict[str, float]:
    """The parity figures of `candidate` against `reference` on the sample, over each tower the candidate runs on
    a graph: min, mean and 1st-percentile cosine of every input's two embeddings, and the neighbour overlap (of
    the images; of the texts for a text-only model)."""
    cosines, overlaps = [], []
    if "image" in candidate.runners:
        batch = sample_batch(reference)
        ours = _reference(reference, "image", lambda: _in_chunks(reference.encode_images, batch))
        theirs = _in_chunks(candidate.encode_images, batch)
        cosines.append(_cosines(ours, theirs))
        overlaps.append(neighbour_overlap(ours, theirs))
    if "text" in candidate.runners:
        ours = _reference(reference, "text", lambda: reference.encode_texts(SAMPLE_TEXTS))
        theirs = candidate.encode_texts(SAMPLE_TEXTS)
        cosines.append(_cosines(ours, theirs))
        if not overlaps:
            overlaps.append(neighbour_overlap(ours, theirs))
    if not cosines:
        raise EncoderError(f"{candidate.spec.name} has nothing a runtime compiles")
    every = np.concatenate(cosines)
    return {"min_cosine": float(every.min()), "mean_cosine": float(every.mean()),
            "p1_cosine": float(np.percentile(every, 1)), "overlap": overlaps[0]}


@dataclass
class DecoderParity(GateFigures):
    """Embeddings of the parity sample decoded by `candidate` against those decoded by `reference`, one encoder."""

    model_id: str
    reference: str
    candidate: str
    min_cosine: float
    mean_cosine: float
    p1_cosine: float
    overlap: float
    gate: dict
    passed: bool
    images: int

    def reason(self) -> str:
        short = self.shortfalls()
        return (f"JPEGs decoded by {self.candidate} against {self.reference} on {self.images} images of the parity "
                "sample: " + "; ".join(short or ["passed"]))

    def to_dict(self) -> dict:
        return asdict(self)


def _files() -> tuple[bytes, ...]:
    """The files the decoder, decode-side and kept-pixels gates decode: the sample's."""
    return _sample_files()


@functools.lru_cache(maxsize=1)
def _sample_files() -> tuple[bytes, ...]:
    """The sample's files as a catalogue stores them (JPEGs of 800-2000 px, PNG cut-outs), not yet decoded: made
    once per host (by one process at a time) and kept in the compiled-model cache, since making them costs about
    20 s; keyed by what makes them (imgest, Pillow and scikit-image's versions)."""
    import PIL
    import skimage

    from imgest.images.demo import product_photos
    from imgest.names import VERSION

    key = json.dumps([SAMPLE, VERSION, PIL.__version__, skimage.__version__])
    path = os.path.join(compiled.root(), "parity-sample",
                        hashlib.sha256(key.encode()).hexdigest()[:24] + ".npz")
    kept = _read_files(path)
    if kept is None:
        with compiled.one_at_a_time(f"parity sample {path}"):  # a second process waits, then reads the first's
            kept = _read_files(path)
            if kept is None:
                kept = tuple(product_photos(SAMPLE_IMAGES, seed=SAMPLE_SEED).values())
                _write_files(path, kept)
    return kept


def _read_files(path: str) -> tuple[bytes, ...] | None:
    """The kept sample, if whole: its files' bytes and their offsets (plain arrays, never a pickle)."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        with np.load(path, allow_pickle=False) as kept:
            data, offsets = kept["data"], kept["offsets"]
        if data.dtype == np.uint8 and offsets.dtype == np.int64 and len(offsets) == SAMPLE_IMAGES + 1 \
                and offsets[0] == 0 and offsets[-1] == len(data) and (np.diff(offsets) > 0).all():
            raw = data.tobytes()
            return tuple(raw[a:b] for a, b in zip(offsets[:-1], offsets[1:]))
    return None


def _write_files(path: str, files: tuple[bytes, ...]) -> None:
    with contextlib.suppress(OSError):  # a cache that cannot be written costs the next process its time only
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex}.npz"
        offsets = np.cumsum([0, *map(len, files)]).astype(np.int64)
        np.savez(tmp, data=np.frombuffer(b"".join(files), np.uint8), offsets=offsets)
        os.replace(tmp, path)


def decoder_parity(encoder, reference: str, candidate: str, files: tuple[bytes, ...] | None = None,
                   side: int | None = None) -> DecoderParity:
    """`candidate`'s parity with `reference` through `encoder` (its preprocessing), each decoding down to `side` (the
    model's recorded decode side; None: the encoder's), on the parity sample's files (or `files`), judged by the
    reduced precision's gate: a decoder moves embeddings as bf16 does."""
    from imgest.images.decode import decode_image
    from imgest.images.decoders import min_side

    files = files or _files()
    side = min_side(encoder, side)
    figures = _paired_figures(encoder, files, lambda data: decode_image(data, min_side=side, decoder=reference),
                              lambda data: decode_image(data, min_side=side, decoder=candidate))
    return DecoderParity(encoder.spec.model_id, reference, candidate, gate=gate("bf16"),
                         passed=passes(figures, "bf16"), images=len(files), **figures)


def side_parity(encoder, decoder: str, side: int, files: tuple[bytes, ...] | None = None) -> DecoderParity:
    """A reduced decode's parity with the processor's own path: JPEGs decoded by `decoder` down to a shorter side of
    `side` against the whole image decoded by Pillow, both through `encoder`'s preprocessing (a transformers
    processor resizes either), on the parity sample's files (or `files`), judged by the reduced precision's gate.
    The sample is fixed, so the verdict is the model's, not a store's: on the sample, it is kept in the host's
    compiled-model cache (one process of the host measures it; every later store of the model reads it)."""
    from imgest.images.decode import decode_image

    def measured(chosen: tuple[bytes, ...]) -> DecoderParity:
        figures = _paired_figures(encoder, chosen, lambda data: decode_image(data),
                                  lambda data: decode_image(data, min_side=side, decoder=decoder))
        return DecoderParity(encoder.spec.model_id, PILLOW_FULL, f"{decoder} down to {side} px", gate=gate("bf16"),
                             passed=passes(figures, "bf16"), images=len(chosen), **figures)

    if files is not None:
        return measured(files)
    key = {"model_id": encoder.spec.model_id, "runtime": getattr(encoder, "runtime", ""), "sample": SAMPLE,
           "precision": getattr(encoder, "precision", ""), "decoder": decoder, "side": side, "check": "decode side"}
    entry = compiled.Entry(os.path.join(compiled.root(), "decode-sides"), key)
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24] + ".json"

    def kept() -> DecoderParity | None:
        record = compiled.read_record(entry, name)
        if record is not None and record.get("key") == key:
            with contextlib.suppress(TypeError):
                return DecoderParity(**record["parity"])
        return None

    parity = kept()
    if parity is None:
        with compiled.one_at_a_time(f"decode side {name}"):  # a second process waits, then reads the first's
            parity = kept()
            if parity is None:
                parity = measured(_files())
                compiled.write_record(entry, name, {"key": key, "parity": parity.to_dict()})
    return parity


def _paired_figures(encoder, files: tuple[bytes, ...], ours, theirs) -> dict[str, float]:
    """The gate's figures of `encoder`'s embeddings of `files` decoded two ways (`ours`, `theirs`: bytes -> image),
    CHUNK images at a time."""
    def embed(decode) -> np.ndarray:
        return np.concatenate([encoder.encode_images(np.stack([encoder.preprocess(decode(data))
                                                               for data in files[i:i + CHUNK]]))
                               for i in range(0, len(files), CHUNK)])

    return paired(embed(ours), embed(theirs))


def paired(reference: np.ndarray, candidate: np.ndarray) -> dict[str, float]:
    """The decoder gate's figures of two embeddings of the same images, row for row (`passes` judges them)."""
    every = _cosines(reference, candidate)
    figures = {"min_cosine": float(every.min()), "mean_cosine": float(every.mean()),
               "p1_cosine": float(np.percentile(every, 1)), "overlap": neighbour_overlap(reference, candidate)}
    return {k: round(v, 7) for k, v in figures.items()}


@dataclass
class KeptParity(GateFigures):
    """Embeddings of the parity sample from kept copies (made at `side` from `source`'s decode, as an ingest that
    keeps pixels makes them) against those from the originals decoded by `reference`, one encoder."""

    model_id: str
    reference: str
    source: str
    side: int
    min_cosine: float
    mean_cosine: float
    p1_cosine: float
    overlap: float
    gate: dict
    passed: bool
    images: int
    copy_bytes: int  # the sample's copies, in all

    def reason(self) -> str:
        return (f"copies at side {self.side} against the originals on {self.images} images of the parity sample: "
                + "; ".join(self.shortfalls() or ["passed"]))

    def to_dict(self) -> dict:
        return {**asdict(self), "shortfalls": self.shortfalls()}


def kept_parity(encoder, reference: str, source: str, side: int, files: tuple[bytes, ...] | None = None,
                need: int | None = None) -> KeptParity:
    """Kept copies' parity with the originals through `encoder`, on the parity sample's files (or `files`), judged by
    the reduced precision's gate: each original decoded by `reference` down to `need` (the model's recorded decode
    side; None: the encoder's), against its copy (from `source`'s decode at `side`, kept as imgest/images/kept.py
    keeps it) decoded and preprocessed."""
    from imgest.images import kept
    from imgest.images.decode import decode_image
    from imgest.images.decoders import min_side

    files = files or _files()
    need = min_side(encoder, need)
    copies: list[bytes] = []

    def from_copy(data: bytes):
        copy = kept.make_copy(decode_image(data, min_side=max(need or 0, side), decoder=source), side)[0]
        copies.append(copy)
        return decode_image(copy, min_side=need)

    figures = _paired_figures(encoder, files, lambda data: decode_image(data, min_side=need, decoder=reference),
                              from_copy)
    return KeptParity(encoder.spec.model_id, reference, source, side, gate=gate("bf16"),
                      passed=passes(figures, "bf16"), images=len(files), copy_bytes=sum(map(len, copies)), **figures)


def _record_name(precision: str, device_key: str) -> str:
    return f"parity-{precision}-{device_key}.json"


def passes(figures: dict[str, float], precision: str) -> bool:
    named = {**figures, f"overlap@{OVERLAP_K}": figures["overlap"]}
    return all(named[name] >= need for name, need in gate(precision).items())


def check(reference, candidate, device_key: str) -> Parity:
    """The candidate's parity with the reference: read from the compiled-model cache, else measured and kept
    there. Raises ParityError when it falls short of its precision's gate."""
    graph = next(iter(candidate.graphs().values()))
    kept = graph.kept_fp32(candidate.precision)
    _, runs_reduced = graph.parts(candidate.precision)  # the record lives with the part run at the precision
    entry = compiled.entry(candidate.spec.model_id, runs_reduced, candidate.runtime,
                           _runtime_version(candidate.runtime))
    name = _record_name(candidate.precision, device_key)
    parity = _kept(entry, name, candidate, kept)
    if parity is None:
        with compiled.one_at_a_time(f"parity {entry.folder} {name}"):  # another process's check: read it after
            parity = _measured(reference, candidate, kept, entry, name)
    if not parity.passed:
        raise ParityError(parity.reason())
    return parity


def _kept(entry, name: str, candidate, kept: str) -> Parity | None:
    record = compiled.read_record(entry, name)
    return _parse(record, candidate, kept) if record is not None else None


def _measured(reference, candidate, kept: str, entry, name: str) -> Parity:
    parity = _kept(entry, name, candidate, kept)
    if parity is None:
        figures = {k: round(v, 7) for k, v in measure(reference, candidate).items()}
        parity = Parity(candidate.spec.model_id, candidate.runtime, candidate.precision, candidate.device,
                        gate=gate(candidate.precision), passed=passes(figures, candidate.precision), kept_fp32=kept,
                        sample=SAMPLE, reference=REFERENCE, host=socket.gethostname(),
                        created=datetime.now(UTC).isoformat(timespec="seconds"), **figures)
        compiled.write_record(entry, name, parity.to_dict())
    return parity


def _parse(record: dict, candidate, kept: str) -> Parity | None:
    """A kept record, if it is whole and about this candidate, the layers it keeps in fp32, the sample and the
    gate (else it is measured again)."""
    try:
        parity = Parity(**record)
    except TypeError:
        return None
    same = (parity.model_id, parity.runtime, parity.precision, parity.kept_fp32, parity.gate, parity.sample) == \
        (candidate.spec.model_id, candidate.runtime, candidate.precision, kept, gate(candidate.precision), SAMPLE)
    whole = all(isinstance(v, float) for v in parity.figures().values())
    return parity if same and whole else None


def _runtime_version(name: str) -> str:
    from imgest.encoders import runtimes

    return runtimes.get(name).version()
