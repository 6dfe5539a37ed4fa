"""Encoder registry: a name resolves to a picklable spec; a spec loads into an encoder on a device."""

from __future__ import annotations

import functools
import threading

from imgest.defaults import DEFAULT_MODEL
from imgest.encoders import efficientnet, head, hf, pixels, text
from imgest.encoders.base import Encoder, EncoderError, EncoderSpec, device_key, resolve_device

# family -> (resolve name -> spec, load spec on device -> encoder)
REGISTRY = {
    efficientnet.NAME: (efficientnet.resolve, efficientnet.load),
    "hf": (hf.resolve, hf.load),
    pixels.NAME: (pixels.resolve, pixels.load),
    "head": (head.resolve, head.load),
    text.NAME: (text.resolve, text.load),
    "st": (None, text.load),  # an hf: folder of a sentence-transformers model (resolved by hf.resolve)
}
KNOWN_NAMES = (efficientnet.NAME, text.NAME, "hf:<hub id or local folder> (CLIP, SigLIP, DINOv2, "
               "sentence-transformers text models)", pixels.NAME,
               "head:<folder or URL written by imgest train-head>")


def _family(name: str) -> str:
    if name.startswith(hf.PREFIX):
        return "hf"
    if name.startswith(head.PREFIX):
        return "head"
    if name in REGISTRY and REGISTRY[name][0] is not None:
        return name
    raise EncoderError(f"unknown model {name!r}; known: {', '.join(KNOWN_NAMES)}")


@functools.lru_cache(maxsize=16)
def resolve(name: str) -> EncoderSpec:
    """Name -> spec, hashing the weights but not loading them (cheap enough for every CLI call)."""
    name = name.strip()
    return REGISTRY[_family(name)][0](name)


_loaded: dict[tuple[str, str, str], Encoder] = {}
_lock = threading.RLock()  # re-entrant: a head loads its base model inside load()


def load(spec: EncoderSpec, device: str = "auto") -> Encoder:
    """Load weights once per process and device; workers call this, never receive a loaded model."""
    device = resolve_device(device)
    key = (spec.model_id, spec.source, device)
    with _lock:
        if key not in _loaded:
            _loaded[key] = REGISTRY[spec.family][1](spec, device)
        return _loaded[key]


__all__ = ["DEFAULT_MODEL", "Encoder", "EncoderError", "EncoderSpec", "REGISTRY", "device_key", "load",
           "resolve", "resolve_device"]
