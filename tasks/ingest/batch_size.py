"""How a run encodes: runtime, precision and batch size, measured on the real model and device, cached in the store.

The candidates are every installed runtime that runs on the device (`--runtime auto`) at every precision the
device computes in natively (`--precision auto`), or the ones named. Each must pass the parity check against
torch fp32 before it is measured (imgest/encoders/parity.py). Each one kept is measured at the run's batch size
when it is fixed, else at one probe batch (PROBE_BATCH); the fastest wins, and with `--batch-size auto` only the
winner's batch size is then tuned over the candidate sizes (a sweep costs about ten probes). A measurement is
cached per (model, device, runtime, precision, batch) in the store and in this host's cache beside its compiled
models (imgest/encoders/compiled.py), so a later run, or a run into another store on the same host, reads it
instead of measuring. When nothing that was asked for can run, the run encodes with torch fp32 (the reference) and
says why in one warning.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field

import numpy as np

from imgest import encoders
from imgest.encoders import Encoder, EncoderError, compiled, device_key, parity, runtimes
from imgest.encoders import precision as precisions
from imgest.state.clock import now_iso
from imgest.state.layout import tuning_key
from imgest.storage import Location
from imgest.timing import Stopwatch

CPU_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
CUDA_CANDIDATES = (1, 8, 16, 32, 64, 128, 256, 512, 1024)
MIN_SECONDS = 1.0  # each batch size is timed for at least this long
PROBE_BATCH = {"cpu": 8, "cuda": 64}  # the batch the runtimes are compared at when the batch is tuned after


@dataclass
class Tuning:
    batch_size: int
    device: str
    device_key: str
    model_id: str
    measured: dict[int, float]  # batch size -> images/s
    stopped: str
    created: str
    runtime: str = "torch"
    precision: str = "fp32"


@dataclass
class Encoding:
    """What a run encodes with, decided once before its first shard: every shard uses it."""

    runtime: str
    precision: str
    batch_size: int
    source: str  # how the batch size was chosen, with the figures: the run summary's batch_size_source
    measured: dict[str, float] = field(default_factory=dict)  # "openvino fp32" -> images/s at `measured_at`
    measured_at: int | None = None  # the batch size the candidates were compared at
    refused: list[str] = field(default_factory=list)  # candidates not used, each with its reason
    parity: float | None = None  # the min cosine against torch fp32 of the one chosen (1.0: it is torch fp32)
    warning: str | None = None  # what was asked for could not run: why, and what runs instead
    encode_seconds: float | None = None  # core-seconds per image of the one chosen (threads / its img/s)
    decode_seconds: float | None = None  # core-seconds per image of reading and decoding (tasks/ingest/encode.py)
    decoder: str = "pillow"  # the model's JPEG decoder in the store (tasks/ingest/decoder.py)
    decode_side: int = 0  # ... and the shorter side it decodes JPEGs down to (0: the whole image)
    decoders: dict[str, float] = field(default_factory=dict)  # the decoder timed -> core-seconds per image
    decoder_source: str = ""  # why that one: the model's default, recorded, explicit past the gate
    decoder_gate: dict | None = None  # an explicit switch: the gate's figures against the one before, or the reason
    side_gate: dict | None = None  # a first run of a gated side: the reduced decode against the whole image

    def to_dict(self) -> dict:
        return asdict(self)

    def costs(self) -> tuple[float, float] | None:
        """(decode, encode) core-seconds per image, when both were measured: how the cores are split."""
        return (self.decode_seconds, self.encode_seconds) if self.decode_seconds and self.encode_seconds else None

    def work_bound(self, cores: int) -> float | None:
        """Images/s the cores could make if nothing but decode and encode ran: cores / (decode + encode)."""
        costs = self.costs()
        return round(cores / sum(costs), 1) if costs else None


def _is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def measure(encoder: Encoder, batch_size: int, min_seconds: float | None = None, min_batches: int = 2) -> float:
    """Images/s at one batch size: warm-up batches, then at least ``min_batches`` timed ones for at least
    ``min_seconds``; the rate of the median batch, so a batch slowed by something else on the machine (a
    process waking, a page fault) does not decide it."""
    from PIL import Image

    # A real preprocessed image (noise), so dtype and layout are exactly what the pipeline feeds.
    noise = np.random.default_rng(0).integers(0, 256, (256, 256, 3), dtype=np.uint8)
    sample = encoder.preprocess(Image.fromarray(noise))
    batch = np.repeat(sample[None], batch_size, axis=0)
    for _ in range(2):  # warm-up: allocator, kernels, autotuning, a runtime's first compile (torch's takes two)
        encoder.encode_images(batch)
    times, running, min_seconds = [], Stopwatch(), MIN_SECONDS if min_seconds is None else min_seconds
    while len(times) < min_batches or running.elapsed < min_seconds:
        one = Stopwatch()
        encoder.encode_images(batch)
        times.append(one.elapsed)
    return batch_size / float(np.median(times))


def tune_batch_size(encoder: Encoder, candidates: tuple[int, ...] | None = None,
                    min_seconds: float | None = None, patience: int = 2) -> Tuning:
    """Try candidates in increasing order; stop at out-of-memory or after ``patience`` sizes that are
    clearly slower (< 90%) than the best so far; then measure the contenders once more, largest first, and
    keep each one's faster figure. Bigger is not assumed to be better: on a small CPU the best batch is often 1."""
    import torch

    device = encoder.device
    candidates = candidates or (CUDA_CANDIDATES if device.startswith("cuda") else CPU_CANDIDATES)
    measured: dict[int, float] = {}
    stopped, worse = "all candidates measured", 0
    for size in candidates:
        try:
            measured[size] = round(measure(encoder, size, min_seconds), 2)
        except RuntimeError as exc:
            if not _is_oom(exc):
                raise
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            stopped = f"out of memory at batch {size}"
            break
        best = max(measured.values())
        worse = worse + 1 if measured[size] < 0.9 * best else 0
        if worse >= patience:
            stopped = f"{patience} sizes slower than the best"
            break
    if not measured:
        raise RuntimeError(f"could not run even batch {candidates[0]} on {device}: {stopped}")
    # The contenders (within 75% of the best) measured again, in the opposite order, keeping each one's faster
    # figure: other work on the machine only ever slows a measurement, and a disturbance lasting a second
    # would otherwise pick the batch size (seen: batch 1 at a sixth of batch 2's rate in one run).
    first = max(measured.values())
    for size in sorted((s for s, rate in measured.items() if rate >= 0.75 * first), reverse=True):
        measured[size] = max(measured[size], round(measure(encoder, size, min_seconds), 2))
    best_size = max(measured, key=measured.get)
    return Tuning(best_size, device, device_key(device), encoder.spec.model_id, measured, stopped, now_iso(),
                  encoder.runtime, encoder.precision)


def _read_tuning(cached: object, key: str, encoder: Encoder) -> Tuning | None:
    """A cached tuning, if it is whole and about this model, device, runtime and precision (a store is
    untrusted: a planted or older file is measured again, never believed)."""
    if cached is None:
        return None
    try:
        tuning = Tuning(**cached)
        tuning.measured = {int(k): float(v) for k, v in dict(tuning.measured).items()}
    except (TypeError, ValueError, AttributeError) as exc:
        logging.getLogger("imgest").warning("tuning %s measured again: %s", key, exc)
        return None
    if (tuning.model_id, tuning.runtime, tuning.precision) != (encoder.spec.model_id, encoder.runtime,
                                                               encoder.precision) \
            or tuning.batch_size not in tuning.measured or not all(v > 0 for v in tuning.measured.values()):
        return None
    return tuning


def _stored(store: Location, key: str) -> object:
    try:
        return store.read_json(key)
    except (OSError, ValueError) as exc:  # a damaged record is measured again
        logging.getLogger("imgest").warning("tuning %s measured again: %s", key, exc)
        return None


def host_folder() -> str:
    """Where this host keeps its measurements, beside its compiled models: a measurement is about the hardware,
    the runtime's release and the model, never about a store, so a second store on the host reads the first's."""
    return os.path.join(compiled.root(), "tuning")


def _host_entry(encoder: Encoder) -> compiled.Entry:
    try:
        version = runtimes.get(encoder.runtime).version()
    except EncoderError:  # runs as it is (raw pixels: numpy): the torch release around it
        version = runtimes.get("torch").version()
    return compiled.Entry(os.path.join(host_folder(), f"{encoder.runtime}-{version}"), {})


def cached_or_tuned(store: Location, encoder: Encoder, fixed: int | None = None) -> tuple[Tuning, bool]:
    """The (model, device, runtime, precision) tuning from the store, else from this host's cache, else a fresh
    measurement; saved in both; and whether it was cached. With `fixed`, only that batch size is measured."""
    key = tuning_key(encoder.spec.slug, device_key(encoder.device), encoder.runtime, encoder.precision, fixed)
    if store.exists(key) and (cached := _read_tuning(_stored(store, key), key, encoder)) is not None:
        return cached, True
    host, name = _host_entry(encoder), key.replace("/", "-")
    tuning = _read_tuning(compiled.read_record(host, name), name, encoder)
    cached = tuning is not None
    if tuning is None:
        with compiled.one_at_a_time(f"tuning {host.folder} {name}"):  # never two timings side by side on a host
            tuning = _read_tuning(compiled.read_record(host, name), name, encoder)  # another's, while this waited
            cached = tuning is not None
            if tuning is None:
                tuning = tune_batch_size(encoder, candidates=(fixed,) if fixed else None)
                compiled.write_record(host, name, asdict(tuning))
    store.write_json(key, asdict(tuning))
    return tuning, cached


def _label(encoder: Encoder) -> str:
    return f"{encoder.runtime} {encoder.precision}"


def candidates(spec, device: str, runtime: str, precision: str) -> tuple[list[Encoder], list[str]]:
    """The encoders a run may use, each loaded and past its parity check, and the refused ones with why."""
    usable: dict[str, Encoder] = {}
    refused = []
    with parity.shared():  # the candidates' checks preprocess the sample once
        for name in runtimes.runtime_candidates(runtime, device):
            for prec in precisions.precision_candidates(precision, device):
                try:
                    encoder = encoders.load(spec, device, name, prec)
                except EncoderError as exc:  # parity, a precision the device lacks, a model it cannot convert
                    refused.append(f"{name} {prec}: {exc}")
                    continue
                usable.setdefault(_label(encoder), encoder)  # one that runs as it is appears once
    return list(usable.values()), refused


def choose_encoding(store_url: str, spec, device: str, runtime: str = "auto", precision: str = "auto",
                    fixed: int | None = None) -> Encoding:
    """The runtime, precision and batch size of a run (module docstring)."""
    usable, refused = candidates(spec, device, runtime, precision)
    warning = None
    if not usable:
        warning = (f"runtime {runtime}, precision {precision} cannot encode {spec.name} here ("
                   f"{'; '.join(refused)}): encoding with torch fp32 instead")
        logging.getLogger("imgest").warning(warning)
        usable = [encoders.load(spec, device, "torch", "fp32")]
    store = Location(store_url)
    compared_at = fixed if fixed is not None or len(usable) == 1 else probe_batch(device)
    # label -> (tuning at `compared_at`, whether cached); nothing to measure when one candidate is left with a
    # fixed batch, and the sweep alone when one is left with an automatic one
    tunings = {} if len(usable) == 1 else {_label(e): cached_or_tuned(store, e, compared_at) for e in usable}
    measured = {label: t.measured[t.batch_size] for label, (t, _) in tunings.items()}
    chosen = max(usable, key=lambda e: measured.get(_label(e), 0.0))
    if fixed is not None:
        batch, source = fixed, "fixed"
        rate = measured.get(_label(chosen))
    else:
        tuning, cached = cached_or_tuned(store, chosen)
        rates = ", ".join(f"{b}: {r}" for b, r in sorted(tuning.measured.items()))
        batch, source = tuning.batch_size, f"auto, {'cached' if cached else 'measured'} img/s by batch {{{rates}}}"
        rate = tuning.measured[batch]
    cost = _threads(device) / rate if rate else None
    figure = getattr(chosen, "parity", 1.0)  # set when it was compiled (1.0: it is torch fp32, or runs as it is)
    return Encoding(chosen.runtime, chosen.precision, batch, source, measured=measured,
                    measured_at=compared_at if measured else None, refused=refused, parity=figure, warning=warning,
                    encode_seconds=round(cost, 6) if cost else None)


def probe_batch(device: str) -> int:
    return PROBE_BATCH["cuda" if device.startswith("cuda") else "cpu"]


def _threads(device: str) -> int:
    import torch

    return 1 if device.startswith("cuda") else torch.get_num_threads()


