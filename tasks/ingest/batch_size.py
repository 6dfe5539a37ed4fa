"""Pick the encode batch size by measuring throughput on the real model and device, cached in the store."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from imgest.encoders import Encoder, device_key
from imgest.storage import Location
from imgest.tasks.state.committed import now_iso
from imgest.timing import Stopwatch

CPU_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
CUDA_CANDIDATES = (1, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass
class Tuning:
    batch_size: int
    device: str
    device_key: str
    model_id: str
    measured: dict[int, float]  # batch size -> images/s
    stopped: str
    created: str


def _is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def measure(encoder: Encoder, batch_size: int, min_seconds: float = 1.0, min_batches: int = 2) -> float:
    """Images/s at one batch size: one warm-up batch, then at least ``min_batches`` timed ones."""
    from PIL import Image

    # A real preprocessed image (noise), so dtype and layout are exactly what the pipeline feeds.
    noise = np.random.default_rng(0).integers(0, 256, (256, 256, 3), dtype=np.uint8)
    sample = encoder.preprocess(Image.fromarray(noise))
    batch = np.repeat(sample[None], batch_size, axis=0)
    encoder.encode_images(batch)  # warm-up: allocator, kernels, autotuning
    done, running = 0, Stopwatch()
    while done < min_batches or running.elapsed < min_seconds:
        encoder.encode_images(batch)
        done += 1
    return batch_size * done / running.elapsed


def tune_batch_size(encoder: Encoder, candidates: tuple[int, ...] | None = None,
                    min_seconds: float = 1.0, patience: int = 2) -> Tuning:
    """Try candidates in increasing order; stop at out-of-memory or after ``patience`` sizes that are
    clearly slower (< 90%) than the best so far. Bigger is not assumed to be better: on a small CPU
    the best batch is often 1."""
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
    best_size = max(measured, key=measured.get)
    return Tuning(best_size, device, device_key(device), encoder.spec.model_id, measured, stopped, now_iso())


def tuning_key(slug: str, key: str) -> str:
    return f"tuning/model={slug}/{key}.json"


def cached_or_tuned(store: Location, encoder: Encoder) -> tuple[Tuning, bool]:
    """The (model, device) tuning from the store, or a fresh measurement saved there; and whether cached."""
    key = tuning_key(encoder.spec.slug, device_key(encoder.device))
    if store.exists(key):
        cached = store.read_json(key)
        cached["measured"] = {int(k): v for k, v in cached["measured"].items()}
        return Tuning(**cached), True
    tuning = tune_batch_size(encoder)
    store.write_json(key, asdict(tuning))
    return tuning, False


def choose_batch_size(store_url: str, spec, device: str, fixed: int | None) -> tuple[int, str]:
    """A fixed size wins; otherwise the cached or freshly measured best for (model, device)."""
    if fixed is not None:
        return fixed, "fixed"
    from imgest import encoders

    store = Location(store_url)
    encoder = encoders.load(spec, device)
    tuning, cached = cached_or_tuned(store, encoder)
    rates = ", ".join(f"{b}: {r}" for b, r in sorted(tuning.measured.items()))
    return tuning.batch_size, f"auto, {'cached' if cached else 'measured'} img/s by batch {{{rates}}}"
