"""The registry of encoder runtimes: what may run an encoder's torch graphs here (eager torch, OpenVINO), and
the refusal, in one line, of what a host cannot run.

An encoder exposes its computation as graphs (imgest/encoders/graphs.py); a runtime turns a graph into a runner
at one precision: `torch` runs the module itself (imgest/encoders/torch_runtime.py), `openvino` converts and
compiles it for the CPU (imgest/encoders/openvino_runtime.py). The precisions a device computes in natively are
imgest/encoders/precision.py's. Which runtime and precision a run uses is decided once, by measurement behind a
parity check (imgest/encoders/parity.py, tasks/ingest/batch_size.py).
"""

from __future__ import annotations

from imgest.encoders.base import EncoderError
from imgest.encoders.graphs import Runtime
from imgest.encoders.openvino_runtime import OpenVINORuntime
from imgest.encoders.precision import native_precisions
from imgest.encoders.torch_runtime import TorchRuntime
from imgest.names import PRECISIONS, RUNTIMES

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
