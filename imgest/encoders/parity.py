"""Parity before use: a runtime and precision must encode a fixed sample as eager torch fp32 does, or not run.

The sample is 16 product photos made from scikit-image's photos (`imgest.demo.product_photos`, seed 0: real
pictures at 800-2000 px, through the encoder's own preprocessing) and, for a model with a text tower, a
fixed list of product queries. The figure is the smallest cosine between the two embeddings of one input.
fp32 must reach 0.99999 (the same arithmetic, reordered); bf16 and fp16 0.999. The first check of a (model,
runtime, precision) on a host is kept beside its compiled model (imgest/encoders/compiled.py) and reused.
"""

from __future__ import annotations

import functools
import io
import socket
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

import numpy as np

from imgest.encoders import compiled
from imgest.encoders.base import EncoderError

FP32_MIN_COSINE = 0.99999
REDUCED_MIN_COSINE = 0.999
SAMPLE_IMAGES, SAMPLE_SEED = 16, 0
SAMPLE_TEXTS = ("a red leather ankle boot", "white sneakers on a wooden floor", "a cup of espresso",
                "a tabby cat", "stainless steel watch with a black strap", "a blue denim jacket",
                "astronaut portrait", "a rocket on the launch pad")
SAMPLE = (f"{SAMPLE_IMAGES} product photos (imgest.demo.product_photos, seed {SAMPLE_SEED}) through the encoder's "
          f"preprocessing; {len(SAMPLE_TEXTS)} fixed texts for a text tower")
REFERENCE = "torch fp32"


class ParityError(EncoderError):
    """A runtime at a precision does not reproduce torch fp32 on the sample; the message gives the figures."""


@dataclass
class Parity:
    model_id: str
    runtime: str
    precision: str
    device: str
    min_cosine: float
    mean_cosine: float
    threshold: float
    passed: bool
    sample: str
    reference: str
    host: str
    created: str

    def reason(self) -> str:
        return (f"{self.runtime} {self.precision} agrees with {self.reference} to a min cosine of "
                f"{self.min_cosine:.6f} on the parity sample, below the {self.threshold} it needs")

    def to_dict(self) -> dict:
        return asdict(self)


def threshold(precision: str) -> float:
    return FP32_MIN_COSINE if precision == "fp32" else REDUCED_MIN_COSINE


@functools.lru_cache(maxsize=4)
def _photos() -> tuple:
    """The sample's pictures, decoded upright in RGB (Pillow; the same pixels go to both sides)."""
    from PIL import Image, ImageOps

    from imgest.demo import product_photos

    images = []
    for data in product_photos(SAMPLE_IMAGES, seed=SAMPLE_SEED).values():
        image = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
        if image.mode != "RGB":
            background = Image.new("RGBA", image.size, (255, 255, 255, 255))
            image = Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
        images.append(image)
    return tuple(images)


def sample_batch(encoder) -> np.ndarray:
    return np.stack([encoder.preprocess(image) for image in _photos()])


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)


def measure(reference, candidate) -> tuple[float, float]:
    """(min, mean) cosine between `reference`'s and `candidate`'s embeddings of the sample, over each tower
    the candidate runs on a graph."""
    cosines = []
    if "image" in candidate.runners:
        batch = sample_batch(reference)
        cosines.append(_cosines(reference.encode_images(batch), candidate.encode_images(batch)))
    if "text" in candidate.runners:
        cosines.append(_cosines(reference.encode_texts(SAMPLE_TEXTS), candidate.encode_texts(SAMPLE_TEXTS)))
    if not cosines:
        raise EncoderError(f"{candidate.spec.name} has nothing a runtime compiles")
    every = np.concatenate(cosines)
    return float(every.min()), float(every.mean())


def _record_name(precision: str, device_key: str) -> str:
    return f"parity-{precision}-{device_key}.json"


def check(reference, candidate, device_key: str) -> Parity:
    """The candidate's parity with the reference: read from the compiled-model cache, else measured and kept
    there. Raises ParityError when it falls short."""
    graph = next(iter(candidate.graphs().values()))
    entry = compiled.entry(candidate.spec.model_id, graph, candidate.runtime, _runtime_version(candidate.runtime))
    name = _record_name(candidate.precision, device_key)
    record = compiled.read_record(entry, name)
    parity = _parse(record, candidate) if record is not None else None
    if parity is None:
        low, mean = measure(reference, candidate)
        need = threshold(candidate.precision)
        parity = Parity(candidate.spec.model_id, candidate.runtime, candidate.precision, candidate.device,
                        round(low, 7), round(mean, 7), need, low >= need, SAMPLE, REFERENCE, socket.gethostname(),
                        datetime.now(UTC).isoformat(timespec="seconds"))
        compiled.write_record(entry, name, parity.to_dict())
    if not parity.passed:
        raise ParityError(parity.reason())
    return parity


def _parse(record: dict, candidate) -> Parity | None:
    """A kept record, if it is whole and about this candidate and threshold (else it is measured again)."""
    try:
        parity = Parity(**record)
    except TypeError:
        return None
    same = (parity.model_id, parity.runtime, parity.precision, parity.threshold, parity.sample) == \
        (candidate.spec.model_id, candidate.runtime, candidate.precision, threshold(candidate.precision), SAMPLE)
    return parity if same and isinstance(parity.min_cosine, float) else None


def _runtime_version(name: str) -> str:
    from imgest.encoders import runtimes

    return runtimes.get(name).version()
