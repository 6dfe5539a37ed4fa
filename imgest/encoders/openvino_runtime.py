"""The OpenVINO runtime: an encoder's torch graph converted once by `ov.convert_model`, kept in the compiled-model
cache (imgest/encoders/compiled.py), compiled for the CPU at the precision asked. A tower split for a reduced
precision (runtimes.Split) is two compiled models, the fp32 head's output handed to the rest without a copy."""

from __future__ import annotations

import functools
import os
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from imgest.encoders.base import EncoderError

if TYPE_CHECKING:
    from imgest.encoders.graphs import Graph, Runner

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
        if not device.startswith("cpu"):
            raise EncoderError(f"openvino runs on the CPU here, not on {device}: use --runtime torch (or auto) there")
        if (why := self.missing()) is not None:
            raise EncoderError(f"runtime openvino: {why}")
        head, rest = graph.parts(precision)
        if head is None:
            return self._compile(graph, precision, model_id)
        return _Chained(self._compile(head, "fp32", model_id), self._compile(rest, precision, model_id))

    def _compile(self, graph: Graph, precision: str, model_id: str) -> _OpenVINORunner:
        import torch

        from imgest.encoders import compiled

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


def compile_job(blobs: str) -> str:
    """The host-wide turn (`compiled.one_at_a_time`) for compiling into the blob folder `blobs`."""
    return f"compile {blobs}"


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
                    self._compiled[threads] = self._compile(threads)
                requests[threads] = self._compiled[threads].create_infer_request()
        return requests[threads]

    def _compile(self, threads: int):
        """CACHE_DIR: OpenVINO keeps the compiled blob (per precision and threads) and maps it from the file when
        it loads it again instead of compiling; pinning off, so decode processes share the cores fairly.
        OpenVINO writes a blob in place, not through a rename, so two processes compiling one model at once (two
        ingests, two workers of a host) could rewrite the file under a third that had mapped it: that process
        dies of SIGBUS at its next inference. One process of the host compiles an entry at a time; the next
        loads the blob the first wrote."""
        from imgest.encoders import compiled

        with compiled.one_at_a_time(compile_job(self.blobs)):
            return _core().compile_model(self.xml, "CPU", {
                "INFERENCE_PRECISION_HINT": self.precision, "INFERENCE_NUM_THREADS": threads,
                "PERFORMANCE_HINT": "LATENCY", "ENABLE_CPU_PINNING": False, "CACHE_DIR": self.blobs})

    def __call__(self, *inputs):
        import torch

        arrays = [x.cpu().numpy() if isinstance(x, torch.Tensor) else np.ascontiguousarray(x) for x in inputs]
        request = self.request(max(1, torch.get_num_threads()))
        out = request.infer(arrays)
        return np.array(out[request.model_outputs[0]], dtype=np.float32)  # a copy: the request reuses its buffer


class _Chained:
    """A split tower on OpenVINO: the fp32 head's output tensors handed to the reduced-precision rest as they are
    (no copy), one request of each per thread."""

    def __init__(self, head: _OpenVINORunner, rest: _OpenVINORunner):
        self.head, self.rest = head, rest

    def __call__(self, *inputs):
        import torch

        threads = max(1, torch.get_num_threads())
        first, second = self.head.request(threads), self.rest.request(threads)
        first.infer([x.cpu().numpy() if isinstance(x, torch.Tensor) else np.ascontiguousarray(x) for x in inputs])
        for i, output in enumerate(first.model_outputs):
            second.set_input_tensor(i, first.get_tensor(output))
        second.infer()
        return np.array(second.get_output_tensor(0).data, dtype=np.float32)
