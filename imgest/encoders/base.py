"""What every encoder offers: a picklable spec, a loaded encoder, device and precision choices."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from imgest.errors import UserError


class EncoderError(UserError, ValueError):
    """A model name, device or modality is not usable; the message lists what is allowed."""


@dataclass(frozen=True)
class EncoderSpec:
    """Everything needed to rebuild an encoder in another process, and to say what made an embedding.

    ``model_id`` pins the weights (content hash or hub revision) and the preprocessing, so two runs
    that write the same model_id produce comparable vectors.
    """

    name: str  # what the user typed: "efficientnet-lite0", "hf:openai/clip-vit-base-patch32"
    family: str  # registry key that loads it
    source: str  # weights file, local folder or hub id
    revision: str  # weights digest or hub commit
    dim: int
    preprocessing: dict[str, Any]
    modalities: tuple[str, ...] = ("image",)
    extra: dict[str, Any] = field(default_factory=dict)
    base: EncoderSpec | None = None  # a head's base model: this model is the head applied to its embeddings

    @property
    def preprocessing_digest(self) -> str:
        return hashlib.sha256(json.dumps(self.preprocessing, sort_keys=True).encode()).hexdigest()[:8]

    @property
    def model_id(self) -> str:
        if self.base is not None:
            return f"{self.base.model_id}+head-{self.revision[:16]}"
        return f"{self.name}@{self.revision[:16]}+pre.{self.preprocessing_digest}"

    @property
    def slug(self) -> str:
        """Folder-safe namespace: readable name plus a digest of the model id."""
        readable = re.sub(r"[^a-zA-Z0-9._-]+", "-", self.name.split("/")[-1].removeprefix("hf:")).strip("-.")
        digest = hashlib.sha256(self.model_id.encode()).hexdigest()[:8]
        return f"{readable.lower() or 'model'}-{digest}"

    def describe(self) -> dict[str, Any]:
        out = asdict(self)
        out["base"] = self.base.describe() if self.base is not None else None
        out.update(model_id=self.model_id, slug=self.slug, modalities=list(self.modalities),
                   normalisation="l2", dtype="float32")
        return out


class Encoder(Protocol):
    spec: EncoderSpec
    device: str
    input_shape: tuple[int, int, int]
    decode_side: int | None  # the shorter side preprocessing needs: a JPEG may decode down to it (None: full)
    runtime: str  # what runs it: torch, openvino (imgest/encoders/runtimes.py); numpy for raw pixels
    precision: str  # fp32, bf16, fp16

    def graphs(self) -> dict:
        """Its towers as torch graphs a runtime can compile ({} when it runs as it is)."""

    def preprocess(self, image) -> np.ndarray:
        """PIL RGB image -> CHW float32 array; runs in decode threads, so it must be thread-safe."""

    def encode_images(self, batch: np.ndarray) -> np.ndarray:
        """NCHW float32 -> (N, dim) float32, L2-normalised."""

    def encode_texts(self, texts: Sequence[str]) -> np.ndarray:
        """Texts -> (N, dim) float32, L2-normalised; raises EncoderError without a text tower."""


def file_digest(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


# What a GPU torch could use shows up as a device file on Linux (NVIDIA's driver, WSL's GPU, AMD's ROCm): without
# one, `auto` is the CPU and torch is not imported to say so (~180 MB: a run deriving a head needs none)
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def resolve_device(device: str) -> str:
    allowed = ("auto", "cpu", "cuda")
    if device not in allowed and not re.fullmatch(r"cuda:\d+", device):
        raise EncoderError(f"unknown device {device!r}; allowed: {', '.join(allowed)} or cuda:N")
    if device == "cpu" or (device == "auto" and sys.platform == "linux" and "torch" not in sys.modules
                           and not any(os.path.exists(path) for path in GPU_DEVICE_FILES)):
        return "cpu"
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EncoderError(f"device {device!r} asked for but CUDA is not available here; use --device cpu or auto")
    return device


NVIDIA_DRIVER = "/proc/driver/nvidia/version"  # the kernel module's version line, where NVIDIA's driver is loaded


def unusable_gpu() -> str | None:
    """Why `--device auto` encodes on the CPU on a host that has a GPU (a device file of GPU_DEVICE_FILES), in one
    line naming the driver and torch's CUDA build, for the run's record and `imgest status`; None where there is
    no GPU, or torch can use it."""
    if not any(os.path.exists(path) for path in GPU_DEVICE_FILES):
        return None
    import warnings

    import torch

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        if torch.cuda.is_available():
            return None
    driver = _driver_version()
    build = torch.version.cuda or torch.version.hip
    if build is None:
        why = f"torch {torch.__version__} is a CPU build: install its CUDA build (infra/Dockerfile, docs/operations.md)"
    else:
        told = next((str(w.message).strip().splitlines()[0] for w in said if "CUDA" in str(w.message)), None)
        why = (f"torch {torch.__version__} is built for CUDA {build} and cannot use it"
               + (f": {told}" if told else " (torch.cuda.is_available() is False: an older driver, or no device "
                                           "visible to this process)"))
    return f"a GPU is here (driver {driver or 'unknown'}) but this run encodes on the CPU: {why}"


def _driver_version() -> str | None:
    try:
        with open(NVIDIA_DRIVER) as fh:
            line = fh.readline()
    except OSError:
        return None
    found = re.search(r"Kernel Module\s+([\d.]+)", line) or re.search(r"\b(\d{3,}\.\d+(?:\.\d+)?)\b", line)
    return found.group(1) if found else None


def device_key(device: str, threads: bool = True) -> str:
    """Stable name of the hardware a tuning result was measured on (with torch's thread count on a CPU, unless
    `threads` is False: a parity figure does not depend on it)."""
    import torch

    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        name = torch.cuda.get_device_name(index)
    else:
        name = _cpu_model()
        name = f"{name}-{torch.get_num_threads()}threads" if threads else name
    return re.sub(r"[^a-zA-Z0-9._-]+", "-", f"{device.split(':')[0]}-{name}").strip("-").lower()


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return os.uname().machine


def to_device(batch, device: str):
    """Host array -> tensor on ``device``; pinned memory and a non-blocking copy on CUDA. A tensor (pixels
    a GPU decode made) moves only if it is elsewhere."""
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    tensor = torch.from_numpy(np.ascontiguousarray(batch))
    if device.startswith("cuda"):
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def l2_normalise(features) -> np.ndarray:
    """Features (a tensor, or the float32 array a compiled runtime returns) -> L2-normalised float32 rows."""
    import torch

    if isinstance(features, np.ndarray):
        features = torch.from_numpy(features)
    features = features.float()
    features = torch.nn.functional.normalize(features, dim=-1)
    return features.detach().cpu().numpy().astype(np.float32, copy=False)
