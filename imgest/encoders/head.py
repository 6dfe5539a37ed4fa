"""A trained embedding head on a base encoder: `head:<folder or URL>` holding head.json and head.safetensors.

The head is a small MLP on the base model's (frozen) embeddings with an L2-normalised output. Its model
id is `<base model id>+head-<sha256 of the weights>`, so each trained head is a model of its own, with
its own namespace in a store; new images are encoded by the base model then the head, and stored base
embeddings can be turned into head embeddings without decoding anything (`project`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from imgest.encoders.base import EncoderError, EncoderSpec, l2_normalise
from imgest.encoders.graph_encoder import GraphEncoder, torch_module
from imgest.encoders.graphs import Graph, Split
from imgest.encoders.precision import default_precision
from imgest.state import layout

PREFIX = "head:"
# A head's folder: head.json (written last: a folder without it is not a head), the weights, and what
# `imgest train-head` keeps beside them: the held-out query set, its augmented query images, loss curves.
CONFIG, WEIGHTS = "head.json", "head.safetensors"
HELDOUT_QUERIES, HELDOUT_VIEWS, LOSS_CURVES = "heldout-queries.jsonl", "heldout", "loss-curves.png"


ARCHITECTURES = {
    "mlp": "Linear(dim_in, hidden) -> GELU -> Linear(hidden, dim_out) -> L2 normalise",
    "residual": "x + Linear(hidden, dim_in)(GELU(Linear(dim_in, hidden)(x))) -> L2 normalise; the second layer "
                "starts at zero, so the untrained head is the identity (equal to the base model)",
    "whiten": "projection @ (x - mean) -> L2 normalise: learned whitening, fitted without labels (its mean and "
              "projection are the weights)",
}
WHITENING_TENSORS = ("mean", "projection")


def mlp(dim_in: int, hidden: int, dim_out: int):
    import torch

    return torch.nn.Sequential(torch.nn.Linear(dim_in, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, dim_out))


def residual(dim: int, hidden: int):
    """x + up(GELU(down(x))) with `up` zero at initialisation: before training the head changes nothing."""
    import torch

    class Residual(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.down, self.up = torch.nn.Linear(dim, hidden), torch.nn.Linear(hidden, dim)
            torch.nn.init.zeros_(self.up.weight)
            torch.nn.init.zeros_(self.up.bias)
            self.out_features = dim

        def forward(self, x):
            return x + self.up(torch.nn.functional.gelu(self.down(x)))

    return Residual()


def build_module(architecture: str, dim_in: int, hidden: int, dim_out: int):
    if architecture == "residual":
        return residual(dim_in, hidden)
    if architecture == "whiten":  # an affine map: weight the projection, bias -projection @ mean
        import torch

        return torch.nn.Linear(dim_in, dim_out)
    return mlp(dim_in, hidden, dim_out)


def whitening_arrays(tensors: dict, config: dict[str, Any], url: str) -> tuple[np.ndarray, np.ndarray]:
    """A whitening head's mean and projection (safetensors read as NumPy), checked (names, dtype, shape)
    before use. A damaged or foreign file is refused in one line."""
    shapes = {"mean": (config["dim_in"],), "projection": (config["dim_out"], config["dim_in"])}
    if set(tensors) != set(WHITENING_TENSORS):
        raise EncoderError(f"head {url}: {WEIGHTS} holds {sorted(tensors)}, not a whitening's mean and projection")
    for name, shape in shapes.items():
        if tensors[name].dtype != np.float32 or tuple(tensors[name].shape) != shape:
            raise EncoderError(f"head {url}: {name} is {tensors[name].dtype} {tuple(tensors[name].shape)}; "
                               f"{CONFIG} says float32 {shape}")
    return tensors["mean"], tensors["projection"]


def affine(mean: np.ndarray, projection: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Whitening as the affine map x @ weight.T + bias that the torch module and `derive` both compute."""
    return projection, -(projection @ mean).astype(np.float32)


def out_features(module) -> int:
    return module.out_features if hasattr(module, "out_features") else module[-1].out_features


def _read(url: str, name: str) -> bytes:
    from imgest.storage import StorageError, read_url

    try:
        return read_url(f"{url.rstrip('/')}/{name}")
    except StorageError as exc:
        raise EncoderError(f"head {url}: {exc}; a head folder holds {CONFIG} and {WEIGHTS} "
                           "(written by `imgest train-head`)") from exc


def resolve(name: str, resolve_base: Callable[[str, str], EncoderSpec]) -> EncoderSpec:
    """A head's spec; `resolve_base(name, where)` resolves the base model its record names (the registry's rules
    for a recorded name: the registry passes it, so that this module never imports the registry back)."""
    url = name[len(PREFIX):].strip()
    if not url:
        raise EncoderError("head: needs a folder or URL, e.g. head:store/heads/<id>")
    from imgest.storage import RecordError, parse_record

    try:
        config = parse_record(_read(url, CONFIG), f"head {url}: {CONFIG}")
        for key, kind in (("base_model", str), ("base_model_id", str), ("dim_in", int), ("hidden", int),
                          ("dim_out", int)):
            if not isinstance(config.get(key) if isinstance(config, dict) else None, kind):
                raise RecordError(f"head {url}: {CONFIG} has no valid {key!r}")
    except RecordError as exc:
        raise EncoderError(str(exc)) from exc
    weights = _read(url, WEIGHTS)
    digest = hashlib.sha256(weights).hexdigest()
    if config.get("weights_sha256") not in (None, digest):
        raise EncoderError(f"head {url}: {WEIGHTS} has sha256 {digest[:16]}..., {CONFIG} says "
                           f"{str(config['weights_sha256'])[:16]}...: refusing a head whose weights were replaced")
    # head.json is a record like any other: its base is only a model this installation has (never a URL)
    base = resolve_base(config["base_model"], f"head {url}: base_model")
    if base.model_id != config["base_model_id"]:
        raise EncoderError(f"head {url} was trained on {config['base_model_id']}, but {config['base_model']} now "
                           f"resolves to {base.model_id}: its weights or preprocessing changed; train the head again")
    return EncoderSpec(name=f"{PREFIX}{url}", family="head", source=url, revision=digest,
                       dim=int(config["dim_out"]), preprocessing=base.preprocessing, modalities=("image",),
                       extra={"config": config}, base=base)


def _weights(url: str, sha256: str | None) -> bytes:
    weights = _read(url, WEIGHTS)
    digest = hashlib.sha256(weights).hexdigest()
    if sha256 is not None and digest != sha256:
        raise EncoderError(f"head {url}: {WEIGHTS} changed since it was resolved (sha256 {digest[:16]}..., "
                           f"model id pins {sha256[:16]}...): refusing to load other weights under its model id")
    return weights


def _tensors(weights: bytes, url: str, load) -> dict:
    try:
        return load(weights)
    except Exception as exc:  # safetensors' own errors: never a half-loaded head
        raise EncoderError(f"head {url}: {WEIGHTS} does not hold the head {CONFIG} describes: "
                           f"{type(exc).__name__}: {str(exc)[:200]}") from exc


def load_whitening(url: str, config: dict[str, Any], sha256: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A whitening head's (weight, bias) as NumPy, from safetensors (never a pickle), without torch."""
    from safetensors.numpy import load as load_arrays

    return affine(*whitening_arrays(_tensors(_weights(url, sha256), url, load_arrays), config, url))


def load_module(url: str, config: dict[str, Any], device: str = "cpu", sha256: str | None = None):
    """The head's MLP from safetensors (never a pickle); with `sha256`, only weights with that checksum
    (the ones the model id was made from) are loaded."""
    import torch
    from safetensors.torch import load as load_tensors

    module = build_module(config.get("head_type", "mlp"), config["dim_in"], config["hidden"], config["dim_out"])
    if config.get("head_type") == "whiten":
        weight, bias = load_whitening(url, config, sha256)
        tensors = {"weight": torch.from_numpy(weight), "bias": torch.from_numpy(bias)}
    else:
        tensors = _tensors(_weights(url, sha256), url, load_tensors)
    try:
        module.load_state_dict(tensors)
    except Exception as exc:  # a state that does not fit: never a half-loaded head
        raise EncoderError(f"head {url}: {WEIGHTS} does not hold the head {CONFIG} describes: "
                           f"{type(exc).__name__}: {str(exc)[:200]}") from exc
    return module.to(device).eval()


def load_state(result):
    """The module of a TrainResult (its best epoch's weights), on the CPU, for scoring."""
    cfg = result.config
    module = build_module(cfg.head_type, result.dim_in, cfg.hidden, cfg.out_dim(result.dim_in))
    module.load_state_dict(result.state_dict)
    return module.eval()


def project(module, vectors: np.ndarray, device: str = "cpu", batch: int = 65536) -> np.ndarray:
    """Base embeddings -> head embeddings (L2-normalised float32); no image is decoded."""
    import torch

    out = np.empty((len(vectors), out_features(module)), np.float32)
    with torch.inference_mode():
        for begin in range(0, len(vectors), batch):
            x = torch.from_numpy(np.ascontiguousarray(vectors[begin:begin + batch], np.float32)).to(device)
            out[begin:begin + batch] = torch.nn.functional.normalize(module(x), dim=1).cpu().numpy()
    return out


def _headed(self, *inputs):
    """The base model's tower (or the rest of it, after its split), its features L2-normalised (as stored base
    embeddings are), then the head."""
    import torch

    return self.head(torch.nn.functional.normalize(self.base(*inputs).float(), dim=-1))


class HeadEncoder(GraphEncoder):
    """The base model's encoder, then the head. The base and the head's module load on first use: a run that
    only derives from stored base vectors (`derive`) loads neither, and a whitening head derives without torch."""

    def __init__(self, spec: EncoderSpec, device: str, load_base: Callable[[EncoderSpec, str], Any]):
        self.spec, self.device, self._load_base = spec, device, load_base
        if spec.extra["config"].get("head_type") == "whiten":
            self._whitening  # noqa: B018 -- its weights checked now, not at the first shard
        else:
            self.module  # noqa: B018
        self._run_on("torch", default_precision(device))

    @functools.cached_property
    def base(self):
        return self._load_base(self.spec.base, self.device)

    @functools.cached_property
    def module(self):
        return load_module(self.spec.source, self.spec.extra["config"], self.device, sha256=self.spec.revision)

    @functools.cached_property
    def _whitening(self) -> tuple[np.ndarray, np.ndarray]:
        return load_whitening(self.spec.source, self.spec.extra["config"], sha256=self.spec.revision)

    @property
    def input_shape(self):
        return self.base.input_shape

    @property
    def decode_side(self):
        return getattr(self.base, "decode_side", None)

    @property
    def gated_decode_side(self) -> bool:  # the base model's images, decoded as its own are
        return getattr(self.base, "gated_decode_side", False)

    @property
    def legacy_decode_side(self):
        return getattr(self.base, "legacy_decode_side", self.decode_side)

    @property
    def preprocess_fn(self):
        """The base model's picklable preprocessing, when it has one: a head's images decode in processes too."""
        return getattr(self.base, "preprocess_fn", None)

    def derive(self, vectors: np.ndarray) -> np.ndarray:
        """Stored base embeddings -> this head's (L2-normalised float32), no image decoded; a whitening head's
        affine map in NumPy, others through `project`."""
        if self.spec.extra["config"].get("head_type") != "whiten":
            return project(self.module, vectors, self.device)
        weight, bias = self._whitening
        out = np.ascontiguousarray(vectors, np.float32) @ weight.T + bias
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)  # as torch's normalize

    def graphs(self) -> dict[str, Graph]:
        if "image" not in (self.base.graphs() if isinstance(self.base, GraphEncoder) else {}):
            return {}  # a base that runs as it is (raw pixels): so does the head
        base = self.base.graphs()["image"]
        tower = torch_module(_headed, base=base.module, head=self.module)
        split = None if base.split is None else Split(  # the base's fp32 layers stay in fp32 under the head too
            base.split.what, base.split.head, torch_module(_headed, base=base.split.rest, head=self.module))
        return {"image": Graph("image", tower, base.example, base.dynamic, split)}

    def _run_on(self, runtime: str, precision: str) -> None:
        if (runtime, precision) == ("torch", default_precision(self.device)):
            # as it always ran: the base model's own encoder, then the head in fp32 (`project`)
            self.runtime, self.precision, self._projected = runtime, precision, True
            self.runners = {"image": lambda batch: project(self.module, self.base.encode_images(batch), self.device)}
            return
        self._projected = False
        super()._run_on(runtime, precision)

    def preprocess(self, image) -> np.ndarray:
        return self.base.preprocess(image)

    def encode_images(self, batch: np.ndarray) -> np.ndarray:
        out = self.runners["image"](batch)
        return out if self._projected else l2_normalise(out)  # `project` normalises already

    def encode_texts(self, texts: Sequence[str]) -> np.ndarray:
        raise EncoderError(f"{self.spec.name} is trained on image embeddings: search it by image, not by text")


def serialise_weights(state_dict) -> bytes:
    """A head's weights as safetensors bytes (read back by `load_module`; never a pickle)."""
    from safetensors.torch import save as save_tensors

    return save_tensors({k: v.contiguous() for k, v in state_dict.items()})


def write_head(store, weights: bytes, config: dict, queries: Iterable[dict], views: dict[str, bytes],
               loss_curves: bytes | None) -> dict:
    """Write `heads/head-<sha256[:12]>/` in `store` (a Location): weights, held-out views (keys under
    HELDOUT_VIEWS), the query set pointing at them (`queries` written a line at a time to a local file, then
    uploaded whole: its relevant lists may name every labelled item), loss curves, then head.json. Returns the
    head's name."""
    head_id = "head-" + hashlib.sha256(weights).hexdigest()[:12]
    folder = layout.head_folder(head_id)
    store.write_bytes(f"{folder}/{WEIGHTS}", weights)
    for key, data in views.items():
        store.write_bytes(f"{folder}/{key}", data)
    with tempfile.TemporaryDirectory(prefix="imgest-head-") as scratch:
        local = os.path.join(scratch, HELDOUT_QUERIES)
        with open(local, "w", encoding="utf-8") as fh:
            for q in queries:
                if q["image"] in views:
                    q = q | {"image": store.uri(f"{folder}/{q['image']}")}
                fh.write(json.dumps(q) + "\n")
        store.put_file(f"{folder}/{HELDOUT_QUERIES}", local)
    if loss_curves is not None:  # a whitening is fitted, not trained: no curves
        store.write_bytes(f"{folder}/{LOSS_CURVES}", loss_curves)
    store.write_json(f"{folder}/{CONFIG}", config)
    return {"head": f"{PREFIX}{store.uri(folder)}", "head_id": head_id, "folder": store.uri(folder),
            "queries": store.uri(f"{folder}/{HELDOUT_QUERIES}")}


def load(spec: EncoderSpec, device: str, load_base: Callable[[EncoderSpec, str], Any]) -> HeadEncoder:
    """`load_base(spec, device)` loads the base model (the registry's `load`, passed in by the registry)."""
    return HeadEncoder(spec, device, load_base)
