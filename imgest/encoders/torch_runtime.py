"""The torch runtime: an encoder's graph run as it is, eager PyTorch with autocast for a reduced precision."""

from __future__ import annotations

import contextlib

from imgest.encoders.graphs import Graph, Runner


def _torch_dtype(precision: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]


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
