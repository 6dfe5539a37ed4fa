"""Field types the configuration models share: each one's type, check and help written once.

A check raises ValueError with a message that starts with the field's name and says what is allowed;
pydantic gathers them and `imgest.config.build` turns them into one line.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, ValidationInfo

from imgest.names import (
    ALIAS_NAME,
    DECODERS,
    DTYPES,
    KINDS,
    PRECISIONS,
    RUNNERS,
    RUNTIMES,
    parse_augmentations,
    parse_disk,
    parse_memory,
)
from imgest.storage import StorageError
from imgest.storage.credentials import check_no_credentials


class Cli:
    """Field metadata for the command line, where its flag is not the field's name (a contract older than the
    model): `Annotated[tuple[int, ...], Cli("--k", str)]` takes `--k 1,5,10` and lets the model parse it."""

    def __init__(self, flag: str, type_: type | None = None):
        self.flag, self.type = flag, type_


# -- checks, each reused by the fields that share it --------------------------------------------------
def not_empty(value: str, info: ValidationInfo) -> str:
    if not str(value or "").strip():
        raise ValueError(f"{info.field_name} must not be empty")
    return value


def not_empty_if_given(value: str | None, info: ValidationInfo) -> str | None:
    return value if value is None else not_empty(value, info)


def no_credentials(value: str | None, info: ValidationInfo) -> str | None:
    if value:
        try:
            check_no_credentials(value, what=info.field_name)
        except StorageError as exc:
            raise ValueError(str(exc)) from None  # the message masks the secret; the input is never echoed
    return value


def at_least(low: int):
    def check(value: int, info: ValidationInfo) -> int:
        if isinstance(value, bool) or value < low:
            raise ValueError(f"{info.field_name} must be an integer >= {low}; got {value!r}")
        return value
    return check


def optional(check):
    """`check` for a value that may also be None (not given)."""
    def checked(value, info: ValidationInfo):
        return None if value is None else check(value, info)
    return checked


def fraction(low_open: bool = False):
    def check(value: float | None, info: ValidationInfo) -> float | None:
        if value is None:  # an optional fraction not given
            return value
        if isinstance(value, bool) or not (0 < value <= 1 if low_open else 0 <= value <= 1):
            interval = "(0, 1]" if low_open else "[0, 1]"
            raise ValueError(f"{info.field_name} must be in {interval}; got {value!r}")
        return value
    return check


def non_negative(meaning: str = ""):
    def check(value: float, info: ValidationInfo) -> float:
        if isinstance(value, bool) or value < 0:
            raise ValueError(f"{info.field_name} must be a number >= 0{meaning}; got {value!r}")
        return value
    return check


def _batch_size(value: str | int) -> str:
    parse_batch_size(value)
    return str(value)


def parse_batch_size(value: str | int) -> int | None:
    """'auto' -> None (measure); a positive integer -> itself."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"batch_size must be 'auto' or a positive integer, got {value!r}") from None
    if size < 1:
        raise ValueError(f"batch_size must be 'auto' or a positive integer, got {value!r}")
    return size


def _device(value: str) -> str:
    if value not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", str(value)):
        raise ValueError(f"device must be one of auto, cpu, cuda, cuda:N; got {value!r}")
    return value


def _runner(value: str) -> str:
    if value not in ("local", "dask") and not value.startswith(("tcp://", "tls://", "ucx://")):
        raise ValueError(f"runner must be {RUNNERS}; got {value!r}")
    return value


def _kind(value: str) -> str:
    if value not in KINDS and not any(t in value for t in ("Flat", "HNSW", "IVF", "PQ", "SQ")):
        raise ValueError(f"kind must be one of {', '.join(KINDS)} or a faiss factory string; got {value!r}")
    return value


def _size(parse):
    def check(value: str) -> str:
        parse(value)
        return value
    return check


def alias_name(value: str | None, info: ValidationInfo) -> str | None:
    if value == "":
        return None  # `--alias ''`: move none
    if value is not None and value != "auto" and not ALIAS_NAME.match(value):
        raise ValueError(f"{info.field_name} must be lowercase letters, digits, '-' or '_' (starting with a letter); "
                         f"got {value!r}")
    return value


def shrinkage_value(value: str) -> str:
    """'auto', or a number from 0 to 1 (a whitening's eigenvalue shrinkage)."""
    if value != "auto":
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if not 0.0 <= number <= 1.0:
            raise ValueError(f"shrinkage must be auto or a number from 0 to 1, got {value!r}")
    return value


def one_of(allowed: tuple[str, ...]):
    def check(value: str, info: ValidationInfo) -> str:
        if value not in allowed:
            raise ValueError(f"{info.field_name} must be one of {', '.join(allowed)}; got {value!r}")
        return value
    return check


def comma_ints(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"ks (--k) must be positive integers separated by commas; got {value!r}") from None


def cut_offs(value: tuple[int, ...]) -> tuple[int, ...]:
    if not value or any(isinstance(k, bool) or k < 1 for k in value):
        raise ValueError(f"ks must be positive integers (cut-offs such as 1, 5, 10); got {list(value)!r}")
    return value


def augmentations(value: str) -> str:
    parse_augmentations(value)
    return value


def encode_limit_name(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9._:-]+", str(value)):
        raise ValueError("encode_limit must be 'auto' (one encode per GPU), 'none' or the name of a Prefect global "
                         f"concurrency limit (letters, digits, . _ : -); got {value!r}")
    return value


# -- fields shared by several flows: type, check and help written once ----------------------------------
Store = Annotated[str, AfterValidator(not_empty), AfterValidator(no_credentials),
                  Field(description="Folder or URL where shards, state and indexes are kept: /path, file://, "
                                    "s3://bucket/prefix")]
Catalogue = Annotated[str, AfterValidator(not_empty), AfterValidator(no_credentials),
                      Field(description="Folder or URL of the catalogue: /path, file://, s3://bucket/prefix")]
OptionalUrl = Annotated[str | None, AfterValidator(no_credentials)]
MODEL_NAMES = ("efficientnet-lite0, efficientnet-lite0-gem, efficientnet-lite0-gem-ms, efficientnet-lite1[-gem[-ms]], "
               "efficientnet-lite2[-gem[-ms]], "
               "minilm-l6, raw-pixels (or raw-pixels-<side>, 2-32), hf:<hub id or local folder>, head:<name>; "
               "or a model the store holds, by name, model id or slug")
OWN_MODEL = "default: the store's own model (its only one; of several, the one the serving alias points at)"
Model = Annotated[str, AfterValidator(not_empty), Field(description=MODEL_NAMES)]
# a model of the store, None until the store is read: `default_model` (imgest/state/models.py) then chooses it
StoreModel = Annotated[str | None, AfterValidator(not_empty_if_given)]
BatchSize = Annotated[str, BeforeValidator(_batch_size),
                      Field(description="'auto' (measured, cached per model and device) or N")]
Device = Annotated[str, AfterValidator(_device), Field(description="auto, cpu, cuda or cuda:N")]
ShardSize = Annotated[int, AfterValidator(at_least(1)),
                      Field(description="Images per shard (one Prefect task, one Parquet file)")]
DecodeWorkers = Annotated[int, AfterValidator(at_least(0)),
                          Field(description="Workers reading and decoding ahead of the encoder; 0: sized from the "
                                            "cores left to it")]
MaxPixels = Annotated[int, AfterValidator(at_least(1)),
                      Field(description="Larger images are rejected as decompression bombs")]
Runner = Annotated[str, AfterValidator(_runner),
                   Field(description="Where shards encode and index parts are added: local (this process), dask "
                                     "(a local Dask cluster of worker processes) or a Dask scheduler address "
                                     "tcp://host:8786")]
Workers = Annotated[int, AfterValidator(at_least(0)),
                    Field(description="Worker processes of a local Dask cluster (runner dask); 0: one per CPU core")]
Dtype = Annotated[str, AfterValidator(one_of(DTYPES)),
                  Field(description="Vectors in the shards this run writes: float32 or float16 (half the bytes; "
                                    "indexes, export, eval and heads read both)")]
Runtime = Annotated[str, AfterValidator(one_of(RUNTIMES)),
                    Field(description="What runs the encoder: auto (the fastest installed runtime that passes the "
                                      "parity check, measured on this model and device and cached), torch or "
                                      "openvino (CPU)")]
Precision = Annotated[str, AfterValidator(one_of(PRECISIONS)),
                      Field(description="The encoder's arithmetic: auto (bf16 where the device runs it natively and "
                                        "it passes the parity check, else fp32), fp32, bf16 or fp16")]
Decoder = Annotated[Annotated[str, AfterValidator(one_of(DECODERS))] | None, Field(
    description="The JPEG decoder (default: the one recorded for the model in this store; on its first run there "
                "simplejpeg, every model's default, recorded). pillow, simplejpeg, turbojpeg or nvjpeg (GPU) "
                "switches the model to it from this run on, recorded, when its embeddings pass the reduced-precision "
                "gate against the recorded decoder's on the parity sample")]
ForceDecoder = Annotated[str | None, Field(
    description="With decoder: switch without the gate (or where it cannot be measured: the recorded decoder not "
                "installed here); the reason is recorded")]
def _keep_side(value: int | None) -> int | None:
    if value is not None and value != 0 and not 32 <= value <= 4096:
        raise ValueError(f"a shorter side from 32 to 4096 pixels, or 0 (off); got {value}")
    return value


KeepPixels = Annotated[int | None, AfterValidator(_keep_side), Field(
    description="Keep a resized copy of each image decoded (shorter side SIDE, aspect kept, JPEG) in the store, so "
                "that a model change reads the copies instead of the catalogue's originals; recorded and kept by "
                "later runs of the model (0 turns it off). Default: the model's recorded setting; a new model "
                "takes the setting of the model whose copies it reads. Never changes the model's own vectors. A model "
                "reads copies when its recorded decode side is no more than SIDE (256: EfficientNet-Lite0 and its "
                "GeM pooling; Lite2 needs 297) and it passes the gate on them")]
Kind = Annotated[str, AfterValidator(_kind),
                 Field(description=f"Index kind: {', '.join(KINDS)} or a faiss factory string")]
Memory = Annotated[str, AfterValidator(_size(parse_memory)),
                   Field(description="Memory budget of the index, e.g. 512M, 4G")]
Disk = Annotated[str, AfterValidator(_size(parse_disk)),
                 Field(description="Local disk for a PQ index's float16 re-rank vectors (memory-mapped when "
                                   "served): 'unlimited', 0 (none: PQ alone) or e.g. 20G")]
TargetRecall = Annotated[float, AfterValidator(fraction(low_open=True)),
                         Field(description="recall@k against exact search the served search parameters must meet")]
RecallK = Annotated[int, AfterValidator(at_least(1)), Field(description="k of the recall target")]


def decoder_choice(config):
    """force_decoder goes with decoder, and says why."""
    if config.force_decoder is not None and not config.force_decoder.strip():
        raise ValueError("force_decoder needs a reason (it is recorded with the model's decoder)")
    if config.force_decoder and not config.decoder:
        raise ValueError("force_decoder needs decoder: the decoder to switch to")
    return config


def workers_need_dask(config):
    """A model's check across its runner and workers fields (both are Runner and Workers fields here)."""
    if config.runner != "dask" and config.workers:
        raise ValueError("workers sets the size of a local Dask cluster: use it with runner 'dask'")
    return config
