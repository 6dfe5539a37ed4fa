"""Which precisions a device computes in natively (the CPU's feature flags; CUDA's own answer), and the ones a run
may try, fastest first."""

from __future__ import annotations

import contextlib
import functools

from imgest.encoders.base import EncoderError
from imgest.names import PRECISIONS


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
