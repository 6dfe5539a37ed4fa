"""What an encoder whose towers are torch graphs shares: its runners, made by a runtime at a precision, and the
same encoder on another runtime or precision; and `torch_module`, which makes a tower of a forward function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from imgest.encoders.graphs import Graph, Runner
from imgest.encoders.runtimes import get


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
