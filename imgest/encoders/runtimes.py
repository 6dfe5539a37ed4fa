"""Encoder runtimes: what runs an encoder's torch graph (eager torch, OpenVINO) and in which precision.

An encoder exposes its computation as `Graph`s (the image tower; a CLIP or SigLIP text tower too): a torch
module taking the batch as the pipeline feeds it, returning features before L2 normalisation. A runtime turns
a graph into a `Runner` (numpy or tensor inputs -> features) at one precision. `torch` runs the module
itself (autocast for bf16 and fp16); `openvino` converts and compiles it for the CPU
(imgest/encoders/openvino_runtime.py). A tower may name the layers a reduced precision keeps in fp32 (`Split`);
both runtimes honour it. Which runtime and precision a run uses is decided once, by measurement behind a parity
check (imgest/encoders/parity.py, tasks/ingest/batch_size.py); this module only knows how to run them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from imgest.encoders.base import EncoderError
from imgest.encoders.openvino_runtime import OpenVINORuntime
from imgest.names import PRECISIONS, RUNTIMES


@dataclass(frozen=True)
class Split:
    """A tower cut where a reduced precision would lose too much: `module(*x) == rest(*head(*x))`, `head` returning
    a tuple of tensors. Under bf16 or fp16 `head` runs in fp32 and `rest` in the reduced precision, as autocast
    keeps its sensitive operations in fp32: the first layers of a CNN see differences in smooth regions that
    bf16's 8-bit mantissa rounds away and the rest of the network amplifies. `what` says which layers."""

    what: str
    head: Any  # torch.nn.Module
    rest: Any  # torch.nn.Module


@dataclass
class Graph:
    """One tower of a loaded encoder as a torch module. `example` is a small input for tracing, of the dtype
    and shape the pipeline feeds; `dynamic` lists, per input, the axes that vary between calls (the batch,
    a text's length). `split`: the layers kept in fp32 under a reduced precision, if any."""

    name: str  # "image" or "text"; a part of a split tower: "image.fp32-head", "image.rest"
    module: Any  # torch.nn.Module
    example: tuple[np.ndarray, ...]
    dynamic: tuple[tuple[int, ...], ...]
    split: Split | None = None

    def input_shapes(self) -> list[list[int]]:
        """The inputs' shapes with -1 on the axes that vary: part of a compiled model's cache key."""
        return [[-1 if axis in dyn else size for axis, size in enumerate(x.shape)]
                for x, dyn in zip(self.example, self.dynamic)]

    def kept_fp32(self, precision: str) -> str:
        """What of the tower runs in fp32 at `precision` though it is reduced ("" for none): in parity records."""
        return self.split.what if self.split is not None and precision != "fp32" else ""

    def parts(self, precision: str) -> tuple[Graph | None, Graph]:
        """What a runtime compiles at `precision`: (the part run in fp32 first, or None; the part at `precision`),
        each a graph of its own with the example traced through the head."""
        if not self.kept_fp32(precision):
            return None, self
        import itertools

        import torch

        device = next(itertools.chain(self.split.head.parameters(), self.split.head.buffers())).device
        with torch.inference_mode():
            middle = self.split.head(*(torch.from_numpy(np.ascontiguousarray(x)).to(device) for x in self.example))
        middle = tuple(t.cpu().numpy() for t in middle)
        batch_axis = tuple((0,) for _ in middle)  # the head keeps the batch axis first, and only it varies
        return (Graph(f"{self.name}.fp32-head", self.split.head, self.example, self.dynamic),
                Graph(f"{self.name}.rest", self.split.rest, middle, batch_axis))


Runner = Callable[..., Any]  # inputs (numpy arrays or tensors) -> features (a tensor or a float32 array)


class Runtime(Protocol):
    name: str

    def missing(self) -> str | None:
        """Why this runtime cannot run here (a package not installed), or None."""

    def version(self) -> str:
        """The runtime's own version: part of a compiled model's cache key."""

    def devices(self) -> tuple[str, ...]:
        """Device kinds it runs on ("cpu", "cuda")."""

    def compile(self, graph: Graph, precision: str, device: str, model_id: str) -> Runner:
        """`graph` as a runner at `precision` on `device`; raises EncoderError when it cannot."""


# -- precision -------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (x86 `flags`, ARM `Features`) from /proc/cpuinfo; empty where unreadable."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def native_precisions(device: str) -> tuple[str, ...]:
    """The precisions `device` computes in natively, fastest first, fp32 last. On a CPU: bf16 with AMX or
    AVX-512 BF16 (ARM: the bf16 feature), fp16 with AVX-512 FP16 or AMX-FP16 (ARM: half-precision SIMD); on CUDA,
    bf16 where the GPU has it, and fp16."""
    if device.startswith("cuda"):
        import torch

        return (("bf16",) if torch.cuda.is_bf16_supported() else ()) + ("fp16", "fp32")
    flags = cpu_flags()
    native = []
    if flags & {"amx_bf16", "avx512_bf16", "bf16"}:
        native.append("bf16")
    if flags & {"avx512_fp16", "amx_fp16", "asimdhp"}:
        native.append("fp16")
    return (*native, "fp32")


def precision_candidates(precision: str, device: str) -> tuple[str, ...]:
    """The precisions a run may use, in the order to try them: `auto` is bf16 where it is native (on CUDA fp16
    next, as the GPU path always had it), then fp32; a named precision is that one alone."""
    if precision not in PRECISIONS:
        raise EncoderError(f"unknown precision {precision!r}; allowed: {', '.join(PRECISIONS)}")
    if precision != "auto":
        return (precision,)
    native = native_precisions(device)
    reduced = [p for p in ("bf16", "fp16") if p in native and (p == "bf16" or device.startswith("cuda"))]
    return (*reduced, "fp32")


def default_precision(device: str) -> str:
    """What a plain `encoders.load` computes in (search, heads, evaluation): the reduced precision CUDA always
    used, fp32 on a CPU."""
    return precision_candidates("auto", device)[0] if device.startswith("cuda") else "fp32"


def _torch_dtype(precision: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]


# -- torch ---------------------------------------------------------------------------------------------------
class TorchRuntime:
    """The module as it is: eager PyTorch, autocast for a reduced precision. The reference of every parity check
    (at fp32) and the one runtime on CUDA."""

    name = "torch"

    def missing(self) -> str | None:
        return None

    def version(self) -> str:
        import torch

        return torch.__version__

    def devices(self) -> tuple[str, ...]:
        return ("cpu", "cuda")

    def compile(self, graph: Graph, precision: str, device: str, model_id: str) -> Runner:
        import torch

        from imgest.encoders.base import to_device

        kind = "cuda" if device.startswith("cuda") else "cpu"
        split = graph.split if graph.kept_fp32(precision) else None

        def run(*inputs):
            cast = (contextlib.nullcontext() if precision == "fp32"
                    else torch.autocast(kind, dtype=_torch_dtype(precision)))
            with torch.inference_mode():
                inputs = tuple(to_device(x, device) for x in inputs)
                if split is not None:
                    inputs = split.head(*inputs)  # in fp32, outside the autocast
                with cast:
                    return (graph.module if split is None else split.rest)(*inputs)

        return run


# -- the registry --------------------------------------------------------------------------------------------
REGISTRY: dict[str, Runtime] = {TorchRuntime.name: TorchRuntime(), OpenVINORuntime.name: OpenVINORuntime()}
assert set(REGISTRY) == set(RUNTIMES) - {"auto"}


def get(name: str) -> Runtime:
    if name not in REGISTRY:
        raise EncoderError(f"unknown runtime {name!r}; known: {', '.join(REGISTRY)} (or auto)")
    return REGISTRY[name]


def runtime_candidates(runtime: str, device: str) -> tuple[str, ...]:
    """The runtimes a run may use: `auto` is every installed one that runs on `device` (on CUDA: torch); a
    named one is that one alone, refused in one line where it cannot run on `device`."""
    if runtime == "auto":
        kind = "cuda" if device.startswith("cuda") else "cpu"
        if kind == "cuda":
            return ("torch",)
        return tuple(n for n, r in REGISTRY.items() if kind in r.devices() and r.missing() is None)
    chosen = get(runtime)
    kind = "cuda" if device.startswith("cuda") else "cpu"
    if kind not in chosen.devices():
        raise EncoderError(f"runtime {runtime} runs on {', '.join(chosen.devices())}, not on {device}: use "
                           "--runtime torch (or auto) there")
    return (runtime,)


def refuse_unusable(runtime: str, precision: str, device: str) -> None:
    """What a run names and this host cannot run at all, refused in one line before any work: a runtime that
    does not run on the device or is not installed, a precision the device does not compute in natively. (A
    runtime that runs but fails its parity check falls back to torch fp32 with a warning instead.)"""
    runtime_candidates(runtime, device)
    if runtime != "auto" and (why := get(runtime).missing()) is not None:
        raise EncoderError(f"runtime {runtime}: {why}; use --runtime auto or torch")
    if precision not in PRECISIONS:
        raise EncoderError(f"unknown precision {precision!r}; allowed: {', '.join(PRECISIONS)}")
    if precision != "auto" and precision not in native_precisions(device):
        raise EncoderError(f"precision {precision}: {device} does not compute in {precision} natively (it does: "
                           f"{', '.join(native_precisions(device))}); use --precision auto or fp32")


class GraphEncoder:
    """What an encoder whose towers are torch graphs shares: `runners` (tower -> Runner) made by a runtime at a
    precision, and `compiled_as`, the same encoder on another runtime or precision (the weights are shared)."""

    runtime: str = "torch"
    precision: str = "fp32"
    parity: float = 1.0  # min cosine against torch fp32 on the parity sample, once checked (imgest/encoders/parity.py)
    runners: dict[str, Runner]
    device: str
    spec: Any

    def graphs(self) -> dict[str, Graph]:
        raise NotImplementedError

    def _run_on(self, runtime: str, precision: str) -> None:
        self.runtime, self.precision = runtime, precision
        chosen = get(runtime)
        self.runners = {name: chosen.compile(graph, precision, self.device, self.spec.model_id)
                        for name, graph in self.graphs().items()}

    def compiled_as(self, runtime: str, precision: str):
        import copy

        twin = copy.copy(self)
        twin._run_on(runtime, precision)
        return twin


def torch_module(forward: Callable, **parts):
    """A torch.nn.Module whose forward is `forward(self, *inputs)`, holding `parts` (modules, buffers as
    tensors) as its attributes: an encoder's tower for a runtime to trace."""
    import torch

    class Tower(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for name, part in parts.items():
                if isinstance(part, torch.nn.Module):
                    self.add_module(name, part)
                else:
                    self.register_buffer(name, part, persistent=False)

    Tower.forward = forward
    return Tower().eval()
