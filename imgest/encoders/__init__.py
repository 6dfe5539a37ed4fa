"""Encoder registry: a name resolves to a picklable spec; a spec loads into an encoder on a device."""

from __future__ import annotations

import functools
import os
import re
import threading

from imgest.encoders import efficientnet, head, hf, parity, pixels, runtimes, text
from imgest.encoders.base import Encoder, EncoderError, EncoderSpec, device_key, resolve_device, unusable_gpu
from imgest.encoders.precision import default_precision, native_precisions
from imgest.names import DEFAULT_MODEL

# family -> (resolve name -> spec, load spec on device -> encoder)
REGISTRY = {
    **{name: (efficientnet.resolve, efficientnet.load) for name in efficientnet.NAMES},
    "hf": (hf.resolve, hf.load),
    pixels.NAME: (pixels.resolve, pixels.load),
    "head": (lambda name: head.resolve(name, _head_base), lambda spec, device: head.load(spec, device, load)),
    text.NAME: (text.resolve, text.load),
    "st": (None, text.load),  # an hf: folder of a sentence-transformers model (resolved by hf.resolve)
}
KNOWN_NAMES = (*efficientnet.NAMES, text.NAME,
               "hf:<hub id or local folder> (CLIP, SigLIP, DINOv2, sentence-transformers text models)", pixels.NAME,
               f"{pixels.NAME}-<side> ({pixels.SIDES.start}-{pixels.SIDES.stop - 1})",
               "head:<folder or URL written by imgest train-head>")


def _head_base(name: str, where: str) -> EncoderSpec:
    """The base model a head's record names: only a model this installation has (never a URL)."""
    return resolve(recorded(name, None, where))


def _family(name: str) -> str:
    if name.startswith(hf.PREFIX):
        return "hf"
    if name.startswith(head.PREFIX):
        return "head"
    if name in REGISTRY and REGISTRY[name][0] is not None:
        return name
    if pixels.sized(name):
        return pixels.NAME
    raise EncoderError(f"unknown model {name!r}; known: {', '.join(KNOWN_NAMES)}")


@functools.lru_cache(maxsize=16)
def resolve(name: str) -> EncoderSpec:
    """Name -> spec, hashing the weights but not loading them (cheap enough for every CLI call)."""
    name = name.strip()
    return REGISTRY[_family(name)][0](name)


# Operators list the places whose models a store record may name (hf:<folder>, a head trained in another store),
# separated like PATH: local folders, or URL prefixes (s3://bucket/heads).
MODEL_DIRS_ENV = "IMGEST_MODEL_DIRS"
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?(@[A-Za-z0-9_.-]{1,64})?$")


def model_dirs() -> list[str]:
    entries = [d.strip() for d in os.environ.get(MODEL_DIRS_ENV, "").split(os.pathsep) if d.strip()]
    return [d.rstrip("/") if "://" in d else os.path.realpath(d) for d in entries]


def _listed(target: str) -> bool:
    """Whether a local folder or a URL lies under one of the places the operator listed (never via '..')."""
    if "://" in target:
        return ".." not in target.split("/") and any(target.startswith(d + "/") for d in model_dirs() if "://" in d)
    real = os.path.realpath(target)
    return any(real == d or real.startswith(d.rstrip("/") + "/") for d in model_dirs() if "://" not in d)


def recorded(name: object, store, where: str) -> str:
    """A model name read from a store record (a card, model.json, a window, head.json), allowed only when it
    names a model this installation already has: a built-in, a head folder inside ``store``, a hub id already
    in the local Hugging Face cache, or a folder under IMGEST_MODEL_DIRS. A record never makes imgest open a
    URL, download from the hub or read a folder the operator did not list. Returns the name to resolve."""
    if not isinstance(name, str) or not name.strip() or len(name) > 1024:
        raise EncoderError(f"{where}: model name {str(name)[:80]!r} is not a model name")
    name = name.strip()
    family = _family(name)
    if family == "head":
        if store is None:
            raise EncoderError(f"{where}: {name[:200]!r}: a head's base model cannot be another head")
        from imgest.storage import ContainmentError

        folder = name[len(head.PREFIX):].strip()
        if _listed(folder):  # a head kept elsewhere (trained in another store) that the operator listed
            return name
        try:
            folder = store.resolve(folder, f"{where}: head folder")
        except ContainmentError as exc:
            raise EncoderError(f"{where}: a head named by a record must lie inside the store or under "
                               f"{MODEL_DIRS_ENV}: {exc}") from exc
        return f"{head.PREFIX}{store.uri(folder)}"
    if family == "hf":
        target = name[len(hf.PREFIX):]
        if _HUB_ID.match(target) and not os.path.isdir(target):
            repo_id, _, rev = target.partition("@")
            hf.cached(repo_id, rev or None, where)  # never a download
            return name
        if not _listed(target):
            raise EncoderError(f"{where}: {name[:200]!r} names a local folder outside the model folders the operator "
                               f"listed in {MODEL_DIRS_ENV} ({os.pathsep.join(model_dirs()) or 'none'}): refused; "
                               f"to use it, list its folder: {MODEL_DIRS_ENV}={_parent(target)}")
    return name


def _parent(target: str) -> str:
    return os.path.dirname(os.path.realpath(target).rstrip("/")) or "/"


def refuse_unrecordable(spec: EncoderSpec, store) -> None:
    """Before a run writes `spec` into `store`: the readers after it (build-index, the nightly, search, the
    migration window) take the model's name back from the store's records through `recorded`, so a name they
    would refuse is refused now, in one line, before anything is listed or encoded, instead of after hours of
    encoding. A head's base is read back the same way."""
    for part, where in ((spec, store), (spec.base, None)):
        if part is None:
            continue
        try:
            recorded(part.name, where, "model")
        except EncoderError as exc:
            raise EncoderError(f"model {part.name[:200]!r} cannot be used with store {store.url}: runs after this "
                               f"one read its name back from the store and would refuse it "
                               f"({str(exc).removeprefix('model: ')})") from exc


def refuse_missing_packages(spec: EncoderSpec) -> None:
    """Before a run loads `spec` in its workers: the packages loading it imports (a head's base model's too) are
    installed here, or one line naming the model and the fix, instead of a failed task after the run started."""
    while spec is not None:
        hf.check_packages(spec)
        spec = spec.base


def resolve_recorded(name: object, store, where: str) -> EncoderSpec:
    """``resolve`` for a name read from a store record, after `recorded` allowed it."""
    allowed = recorded(name, store, where)
    if allowed.startswith(head.PREFIX):
        return head.resolve(allowed, lambda base, _: resolve(recorded(base, None, f"{where}: base")))
    return resolve(allowed)


_loaded: dict[tuple[str, str, str, str, str], Encoder] = {}
_lock = threading.RLock()  # re-entrant: a head loads its base model inside load()


def load(spec: EncoderSpec, device: str = "auto", runtime: str = "torch", precision: str | None = None) -> Encoder:
    """Load weights once per process and device; workers call this, never receive a loaded model.

    Without `precision`: torch at the precision this device always used (search, heads, evaluation). With it, the
    towers are compiled by `runtime` at that precision, and anything but torch fp32 must pass the parity check
    first (imgest/encoders/parity.py), else ParityError: the CUDA default named explicitly is checked too. An
    encoder with nothing to compile (raw pixels, a sentence-transformers model) runs as it is, and says so in
    its `runtime`."""
    device = resolve_device(device)
    plain = (spec.model_id, spec.source, device, "torch", None)
    key = (spec.model_id, spec.source, device, runtime, precision)
    with _lock:
        if plain not in _loaded:
            _loaded[plain] = REGISTRY[spec.family][1](spec, device)
        if key not in _loaded:
            if runtime == "torch" and precision in (None, "fp32") and not device.startswith("cuda"):
                _loaded[key] = _loaded[plain]  # the plain CPU encoder is torch fp32: the reference itself
            else:
                _loaded[key] = _compiled(_loaded[plain], spec, device, runtime,
                                         precision or default_precision(device))
        return _loaded[key]


def _compiled(plain: Encoder, spec: EncoderSpec, device: str, runtime: str, precision: str) -> Encoder:
    if not plain.graphs():  # runs as it is, whatever was asked (its `runtime` says what it is)
        return plain
    runtimes.runtime_candidates(runtime, device)  # refuses a runtime that does not run on this device
    if precision not in native_precisions(device):
        raise EncoderError(f"{device} does not compute in {precision} natively (it does: "
                           f"{', '.join(native_precisions(device))}); use --precision auto or fp32")
    try:
        candidate = plain.compiled_as(runtime, precision)
        candidate.parity = 1.0
        if (runtime, precision) != ("torch", "fp32"):
            candidate.parity = parity.check(load(spec, device, "torch", "fp32"), candidate,
                                            device_key(device, threads=False)).min_cosine
    except EncoderError:
        raise
    except Exception as exc:  # a model a runtime cannot run is that runtime's refusal, never a failed night
        raise EncoderError(f"{runtime} {precision} cannot run {spec.name}: {type(exc).__name__}: "
                           f"{str(exc).strip()[:300]}") from exc
    return candidate


__all__ = ["DEFAULT_MODEL", "Encoder", "EncoderError", "EncoderSpec", "REGISTRY", "device_key", "load", "parity",
           "recorded", "refuse_missing_packages", "refuse_unrecordable", "resolve", "resolve_device", "unusable_gpu",
           "resolve_recorded", "runtimes"]
