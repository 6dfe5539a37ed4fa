"""Encoder runtimes: what runs an encoder's torch graph (eager torch, OpenVINO) and in which precision.

An encoder exposes its computation as `Graph`s (the image tower; a CLIP or SigLIP text tower too): a torch
module taking the batch as the pipeline feeds it, returning features before L2 normalisation. A runtime turns
a graph into a `Runner` (numpy or tensor inputs -> features) at one precision. `torch` runs the module
itself (autocast for bf16 and fp16); `openvino` converts it once with `ov.convert_model`, keeps the converted
model in the local compiled-model cache (imgest/encoders/compiled.py) and compiles it for the CPU at the
precision asked. Which one a run uses is decided once, by measurement behind a parity check
(imgest/encoders/parity.py, tasks/ingest/batch_size.py); this module only knows how to run them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from imgest.encoders.base import EncoderError
from imgest.names import PRECISIONS, RUNTIMES


@dataclass
class Graph:
    """One tower of a loaded encoder as a torch module. `example` is a small input for tracing, of the dtype
    and shape the pipeline feeds; `dynamic` lists, per input, the axes that vary between calls (the batch,
    a text's length). `on_device`: the module already sits on the encoder's device."""

    name: str  # "image" or "text"
    module: Any  # torch.nn.Module
    example: tuple[np.ndarray, ...]
    dynamic: tuple[tuple[int, ...], ...]

    def input_shapes(self) -> list[list[int]]:
        """The inputs' shapes with -1 on the axes that vary: part of a compiled model's cache key."""
        return [[-1 if axis in dyn else size for axis, size in enumerate(x.shape)]
                for x, dyn in zip(self.example, self.dynamic)]


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
        module = graph.module

        def run(*inputs):
            cast = (contextlib.nullcontext() if precision == "fp32"
                    else torch.autocast(kind, dtype=_torch_dtype(precision)))
            with torch.inference_mode(), cast:
                return module(*(to_device(x, device) for x in inputs))

        return run


# -- OpenVINO -----------------------------------------------------------------------------------------------------
OV_PRECISION = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}


class OpenVINORuntime:
    """The module converted by `ov.convert_model` (traced once, kept in the compiled-model cache) and compiled
    for the CPU at the precision asked, with as many threads as torch has at the call (the pipeline's split of
    the cores). One infer request per thread: searches and the pipeline may call from several."""

    name = "openvino"

    def missing(self) -> str | None:
        _decline_telemetry()  # before openvino is first imported: importing its converter reports too
        try:
            import openvino  # noqa: F401
        except ImportError as exc:
            return f"the openvino package is not installed ({exc})"
        return None

    def version(self) -> str:
        _decline_telemetry()
        import openvino

        return openvino.get_version()

    def devices(self) -> tuple[str, ...]:
        return ("cpu",)

    def compile(self, graph: Graph, precision: str, device: str, model_id: str) -> Runner:
        from imgest.encoders import compiled

        if not device.startswith("cpu"):
            raise EncoderError(f"openvino runs on the CPU here, not on {device}: use --runtime torch (or auto) there")
        if (why := self.missing()) is not None:
            raise EncoderError(f"runtime openvino: {why}")
        import torch

        entry = compiled.entry(model_id, graph, self.name, self.version())
        for attempt in (1, 2):
            try:
                xml = compiled.ensure(entry, functools.partial(_convert, graph))
                runner = _OpenVINORunner(xml, compiled.blob_dir(entry), OV_PRECISION[precision])
                runner.request(max(1, torch.get_num_threads()))  # compiled now, not in the middle of a shard
                return runner
            except Exception as exc:  # OpenVINO raises its own types for a graph it cannot convert or compile
                if attempt == 1 and compiled.discard(entry):
                    continue  # a damaged cached entry: converted once more
                reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
                raise EncoderError(f"openvino cannot compile the {graph.name} tower of {model_id}: "
                                   f"{type(exc).__name__}: {reason}") from exc
        raise AssertionError("unreachable")


def _convert(graph: Graph, folder: str) -> None:
    """Trace and convert `graph` into an OpenVINO IR (model.xml, model.bin) in `folder`, weights kept in fp32."""
    import openvino as ov
    import torch

    example = tuple(torch.from_numpy(np.ascontiguousarray(x)) for x in graph.example)
    shapes = [(ov.PartialShape(shape), ov.Type(np.dtype(x.dtype).type))
              for shape, x in zip(graph.input_shapes(), graph.example)]
    _decline_telemetry()
    with torch.inference_mode():
        model = ov.convert_model(graph.module, example_input=example if len(example) > 1 else example[0],
                                 input=shapes)
    # compress_to_fp16 would round the weights to fp16 in the file: fp32 must give torch fp32's embeddings
    ov.save_model(model, os.path.join(folder, "model.xml"), compress_to_fp16=False)


@functools.lru_cache(maxsize=1)
def _decline_telemetry() -> None:
    """OpenVINO's converter reports usage to Google Analytics unless the user opted out (on importing it and on
    every conversion), forking a process to send each event: from a worker holding threads (Prefect's,
    torch's) that fork can deadlock or crash (seen here: a child stuck on OpenSSL's lock, segfaults), and a
    batch job over a catalogue does not report home. This process answers the consent check as declined,
    which is what `opt_in_out --opt_out` records for a user."""
    try:
        from openvino_telemetry.utils import opt_in_checker
    except ImportError:  # a release without it sends nothing
        return
    declined = opt_in_checker.ConsentCheckResult.DECLINED
    opt_in_checker.OptInChecker.check = lambda self, *args, **kwargs: declined


@functools.lru_cache(maxsize=1)
def _core():
    import openvino as ov

    return ov.Core()


class _OpenVINORunner:
    def __init__(self, xml: str, blobs: str, precision: str):
        self.xml, self.blobs, self.precision = xml, blobs, precision
        self._compiled: dict[int, Any] = {}
        self._local = threading.local()
        self._lock = threading.Lock()

    def request(self, threads: int):
        requests = self._local.__dict__.setdefault("requests", {})
        if threads not in requests:
            with self._lock:
                if threads not in self._compiled:
                    # CACHE_DIR: OpenVINO keeps the compiled blob (per precision and threads) and reloads it
                    # instead of compiling again; pinning off, so decode processes share the cores fairly
                    self._compiled[threads] = _core().compile_model(self.xml, "CPU", {
                        "INFERENCE_PRECISION_HINT": self.precision, "INFERENCE_NUM_THREADS": threads,
                        "PERFORMANCE_HINT": "LATENCY", "ENABLE_CPU_PINNING": False, "CACHE_DIR": self.blobs})
                requests[threads] = self._compiled[threads].create_infer_request()
        return requests[threads]

    def __call__(self, *inputs):
        import torch

        arrays = [x.cpu().numpy() if isinstance(x, torch.Tensor) else np.ascontiguousarray(x) for x in inputs]
        request = self.request(max(1, torch.get_num_threads()))
        out = request.infer(arrays)
        return np.array(out[request.model_outputs[0]], dtype=np.float32)  # a copy: the request reuses its buffer


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
