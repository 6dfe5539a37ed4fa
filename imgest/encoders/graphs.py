"""An encoder's computation as runtimes see it: a tower as a torch `Graph` (with the layers a reduced precision
keeps in fp32, `Split`), the `Runner` a runtime makes of it, and the `Runtime` protocol every runtime follows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


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
