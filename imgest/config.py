"""Each flow's configuration, typed and validated before any work starts; every default is declared here once.

Flows, the command line and the deployments take their defaults from these names, so a deployment run
and a CLI run with the same values do the same thing, and a bad value fails on the flow's first line
with one line naming the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import asdict, dataclass, field

from imgest.defaults import (
    DEFAULT_ALIAS,
    DEFAULT_BATCH_SIZE,
    DEFAULT_DECODE_WORKERS,
    DEFAULT_DEVICE,
    DEFAULT_DISK,
    DEFAULT_DTYPE,
    DEFAULT_DUPLICATE_THRESHOLD,
    DEFAULT_ENCODE_LIMIT,
    DEFAULT_INDEX_PARTS,
    DEFAULT_K,
    DEFAULT_KIND,
    DEFAULT_KS,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_DELETE_FRACTION,
    DEFAULT_MAX_PIXELS,
    DEFAULT_MEMORY,
    DEFAULT_MODEL,
    DEFAULT_RECALL_QUERIES,
    DEFAULT_RESAMPLES,
    DEFAULT_RETAIN_DAYS,
    DEFAULT_RETRAIN_SHARE,
    DEFAULT_RUNNER,
    DEFAULT_SHARD_SIZE,
    DEFAULT_TARGET_RECALL,
    DEFAULT_VIEWS,
    DEFAULT_WORKERS,
)
from imgest.storage import check_no_credentials
from imgest.tasks.aliases import ALIAS_NAME
from imgest.tasks.heads import HeadConfig
from imgest.tasks.index_choice import KINDS, IndexChoiceError, parse_disk, parse_memory
from imgest.tasks.migration import ACTIONS
from imgest.tasks.shards import DTYPES

HEAD = HeadConfig()  # train-head's defaults (loss, dimensions, P x K batches, early stopping)

RUNNERS = "local, dask, or a Dask scheduler address (tcp://host:8786, tls://...)"


class ConfigError(ValueError):
    """A parameter is out of range; the message names it and says what is allowed."""


# -- checks shared by the configurations ---------------------------------------------------------------
def parse_batch_size(value: str | int) -> int | None:
    """'auto' -> None (measure); a positive integer -> itself."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"batch_size must be 'auto' or a positive integer, got {value!r}") from None
    if size < 1:
        raise ConfigError(f"batch_size must be 'auto' or a positive integer, got {value!r}")
    return size


def check_runner(runner: str, workers: int) -> None:
    if runner not in ("local", "dask") and not runner.startswith(("tcp://", "tls://", "ucx://")):
        raise ConfigError(f"runner must be {RUNNERS}; got {runner!r}")
    if not isinstance(workers, int) or workers < 0:
        raise ConfigError(f"workers must be an integer >= 0 (0: one per CPU core); got {workers!r}")
    if runner != "dask" and workers:
        raise ConfigError("workers sets the size of a local Dask cluster: use it with runner 'dask'")


def check_device(device: str) -> None:
    if device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", str(device)):
        raise ConfigError(f"device must be one of auto, cpu, cuda, cuda:N; got {device!r}")


def check_not_empty(**values: str | None) -> None:
    for name, value in values.items():
        if not str(value or "").strip():
            raise ConfigError(f"{name} must not be empty")


def check_urls(**urls: str | None) -> None:
    """No credentials inside a URL: refused before they reach run parameters, logs or artifacts."""
    for name, url in urls.items():
        if url:
            check_no_credentials(url, what=name)


def check_at_least(low: int | float, **values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{name} must be an integer >= {low}; got {value!r}")


def check_index(kind: str, memory: str, target_recall: float, disk: str = DEFAULT_DISK) -> None:
    if kind not in KINDS and not any(t in kind for t in ("Flat", "HNSW", "IVF", "PQ", "SQ")):
        raise ConfigError(f"kind must be one of {', '.join(KINDS)} or a faiss factory string; got {kind!r}")
    try:
        parse_memory(memory)
        parse_disk(disk)
    except IndexChoiceError as exc:
        raise ConfigError(str(exc)) from None
    if not isinstance(target_recall, int | float) or not 0 < target_recall <= 1:
        raise ConfigError(f"target_recall must be in (0, 1]; got {target_recall!r}")


def check_alias(name: str, alias: str | None) -> None:
    if alias is not None and not ALIAS_NAME.match(alias):
        raise ConfigError(f"{name} must be lowercase letters, digits, '-' or '_' (starting with a letter); "
                          f"got {alias!r}")


# -- one configuration per flow ----------------------------------------------------------------------------
@dataclass(frozen=True)
class IngestConfig:
    """ingest and reencode."""

    catalogue: str
    store: str
    model: str = DEFAULT_MODEL
    batch_size: str = DEFAULT_BATCH_SIZE
    device: str = DEFAULT_DEVICE
    shard_size: int = DEFAULT_SHARD_SIZE
    decode_workers: int = DEFAULT_DECODE_WORKERS
    max_pixels: int = DEFAULT_MAX_PIXELS
    runner: str = DEFAULT_RUNNER
    workers: int = DEFAULT_WORKERS
    encode_limit: str = DEFAULT_ENCODE_LIMIT
    max_bytes: int = DEFAULT_MAX_BYTES  # a larger object is rejected from its listing size, never read
    max_delete_fraction: float = DEFAULT_MAX_DELETE_FRACTION  # of the live items one run may tombstone
    allow_mass_delete: bool = False  # the deletions are real: lift max_delete_fraction for this run
    dtype: str = DEFAULT_DTYPE  # of the vectors in the shards this run writes: float32 or float16
    metadata: str | None = None  # catalogue metadata (Parquet, CSV, JSONL) stored with the run; text models read it
    inventory: str | None = None  # an S3 Inventory manifest.json listing the catalogue's bucket, read instead of LIST

    def __post_init__(self) -> None:
        check_not_empty(catalogue=self.catalogue, store=self.store, model=self.model)
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        check_urls(catalogue=self.catalogue, store=self.store, metadata=self.metadata, inventory=self.inventory)
        if self.inventory and not self.catalogue.startswith(("s3://", "s3a://")):
            raise ConfigError(f"inventory: an S3 Inventory lists an S3 bucket; the catalogue is {self.catalogue}")
        if self.inventory and not self.inventory.endswith("manifest.json"):
            raise ConfigError(f"inventory must be the URL of a report's manifest.json; got {self.inventory}")
        check_runner(self.runner, self.workers)
        if not re.fullmatch(r"[A-Za-z0-9._:-]+", str(self.encode_limit)):
            raise ConfigError("encode_limit must be 'auto' (one encode per GPU), 'none' or the name of a Prefect "
                              f"global concurrency limit (letters, digits, . _ : -); got {self.encode_limit!r}")
        parse_batch_size(self.batch_size)
        check_at_least(1, shard_size=self.shard_size, max_pixels=self.max_pixels, max_bytes=self.max_bytes)
        check_at_least(0, decode_workers=self.decode_workers)
        check_device(self.device)
        if isinstance(self.max_delete_fraction, bool) or not isinstance(self.max_delete_fraction, int | float) \
                or not 0 <= self.max_delete_fraction <= 1:
            raise ConfigError(f"max_delete_fraction must be in [0, 1]; got {self.max_delete_fraction!r}")

    @property
    def fixed_batch_size(self) -> int | None:
        return parse_batch_size(self.batch_size)

    @property
    def delete_limit(self) -> float | None:
        """The fraction of live items a run may tombstone; None when --allow-mass-delete lifts it."""
        return None if self.allow_mass_delete else self.max_delete_fraction

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class IndexConfig:
    """build-index."""

    store: str
    model: str = DEFAULT_MODEL
    kind: str = DEFAULT_KIND
    memory: str = DEFAULT_MEMORY
    target_recall: float = DEFAULT_TARGET_RECALL
    k: int = DEFAULT_K
    queries: int = DEFAULT_RECALL_QUERIES
    disk: str = DEFAULT_DISK  # local disk for a PQ index's float16 re-rank vectors ("unlimited", "0", "20G")
    alias: str | None = DEFAULT_ALIAS  # a name, "auto" (follow the model's aliases) or None (move none)
    parts: int = DEFAULT_INDEX_PARTS  # >1: train once here, add that many slices in parallel on `runner`, merge
    runner: str = DEFAULT_RUNNER
    workers: int = DEFAULT_WORKERS
    rebuild: bool = False  # train a new version from scratch, even when nothing changed or an update would do
    retrain_share: float = DEFAULT_RETRAIN_SHARE  # ... and once this share of its training count was added since

    def __post_init__(self) -> None:
        check_not_empty(store=self.store, model=self.model)
        check_urls(store=self.store)
        check_runner(self.runner, self.workers)
        check_at_least(1, parts=self.parts, k=self.k, queries=self.queries)
        if isinstance(self.retrain_share, bool) or not isinstance(self.retrain_share, int | float) \
                or not 0 <= self.retrain_share:
            raise ConfigError(f"retrain_share must be a number >= 0 (0: retrain on any addition); "
                              f"got {self.retrain_share!r}")
        check_index(self.kind, self.memory, self.target_recall, self.disk)
        if self.alias != "auto":
            check_alias("alias", self.alias)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class NightlyConfig(IngestConfig):
    """nightly: an ingest and an index build per model, both validated before either starts."""

    model: str | None = None  # None: the models the store's aliases point at (DEFAULT_MODEL for a new store)
    kind: str = DEFAULT_KIND
    memory: str = DEFAULT_MEMORY
    target_recall: float = DEFAULT_TARGET_RECALL
    k: int = DEFAULT_K
    index_parts: int = DEFAULT_INDEX_PARTS
    disk: str = DEFAULT_DISK
    report_duplicates: bool = False  # after the builds: duplicate groups of the serving model, new ones counted

    def __post_init__(self) -> None:
        self.ingest(self.model or DEFAULT_MODEL)
        self.index(self.model or DEFAULT_MODEL)

    def ingest(self, model: str) -> IngestConfig:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(IngestConfig)}
        return IngestConfig(**{**fields, "model": model})

    def index(self, model: str) -> IndexConfig:
        # alias "auto": each rebuilt index moves the aliases already on its model (serving, shadow, previous)
        return IndexConfig(store=self.store, model=model, kind=self.kind, memory=self.memory,
                           target_recall=self.target_recall, k=self.k, alias=DEFAULT_ALIAS, parts=self.index_parts,
                           runner=self.runner, workers=self.workers, disk=self.disk)


@dataclass(frozen=True)
class MigrateConfig:
    """migrate: one window action; `start` re-encodes and builds the new model's index."""

    store: str
    action: str
    to: str | None = None
    catalogue: str | None = None
    gate: dict | None = None
    margin: float = 0.0
    force: str | None = None
    retain_days: float = DEFAULT_RETAIN_DAYS
    batch_size: str = DEFAULT_BATCH_SIZE
    device: str = DEFAULT_DEVICE
    kind: str = DEFAULT_KIND
    memory: str = DEFAULT_MEMORY
    target_recall: float = DEFAULT_TARGET_RECALL
    shard_size: int = DEFAULT_SHARD_SIZE
    disk: str = DEFAULT_DISK

    def __post_init__(self) -> None:
        check_not_empty(store=self.store)
        check_urls(store=self.store, catalogue=self.catalogue)
        if self.action not in ACTIONS:
            raise ConfigError(f"action must be one of {', '.join(ACTIONS)}; got {self.action!r}")
        if self.action == "start":
            check_not_empty(to=self.to)
        if self.gate is not None and not isinstance(self.gate, dict):
            raise ConfigError("gate must be the JSON object `imgest eval --alias serving --compare shadow` writes")
        if self.force is not None and not self.force.strip():
            raise ConfigError("force needs a reason (it is recorded in the window and the alias history)")
        if not isinstance(self.margin, int | float) or self.margin < 0:
            raise ConfigError(f"margin must be a number >= 0 (the drop of the metric allowed); got {self.margin!r}")
        if not isinstance(self.retain_days, int | float) or self.retain_days < 0:
            raise ConfigError(f"retain_days must be a number >= 0; got {self.retain_days!r}")
        parse_batch_size(self.batch_size)
        check_device(self.device)
        check_at_least(1, shard_size=self.shard_size)
        check_index(self.kind, self.memory, self.target_recall, self.disk)


@dataclass(frozen=True)
class EvalConfig:
    """eval: a labelled query set against one alias, or two compared."""

    store: str
    queries: str
    alias: str = "serving"
    compare: str | None = None
    ks: tuple[int, ...] = DEFAULT_KS
    resamples: int = DEFAULT_RESAMPLES
    seed: int = 0
    out: str | None = None
    device: str = DEFAULT_DEVICE
    traffic: str | None = None  # a query log's class counts: the traffic-weighted gain of the second retriever

    def __post_init__(self) -> None:
        check_not_empty(store=self.store, queries=self.queries)
        check_urls(store=self.store, queries=self.queries, out=self.out, traffic=self.traffic)
        if self.traffic and not self.compare:
            raise ConfigError("traffic needs compare: the gain is that of adding the compared retriever")
        check_alias("alias", self.alias)
        check_alias("compare", self.compare)
        if not self.ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in self.ks):
            raise ConfigError(f"ks must be positive integers (cut-offs such as 1, 5, 10); got {list(self.ks)!r}")
        check_at_least(1, resamples=self.resamples)
        check_device(self.device)


@dataclass(frozen=True)
class DuplicatesConfig:
    """duplicates: exact and near-duplicate groups of one image model's live items."""

    store: str
    alias: str | None = "serving"
    model: str | None = None
    threshold: float = DEFAULT_DUPLICATE_THRESHOLD

    def __post_init__(self) -> None:
        check_not_empty(store=self.store)
        check_urls(store=self.store)
        check_alias("alias", self.alias)
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int | float) \
                or not 0 < self.threshold <= 1:
            raise ConfigError(f"threshold must be a cosine in (0, 1]; got {self.threshold!r}")


@dataclass(frozen=True)
class TrainHeadConfig:
    """train-head: where the base embeddings are, the labels (or augmented views), and the training."""

    store: str
    base_model: str = DEFAULT_MODEL
    labels: str | None = None
    views: int = DEFAULT_VIEWS
    max_items: int = 0
    augment: str = "all"
    eval_queries: str | None = None
    catalogue: str | None = None
    training: HeadConfig = field(default_factory=HeadConfig)

    def __post_init__(self) -> None:
        from imgest.tasks.head_views import parse_augmentations

        check_not_empty(store=self.store, base_model=self.base_model)
        check_urls(store=self.store, labels=self.labels, eval_queries=self.eval_queries, catalogue=self.catalogue)
        check_at_least(1, views=self.views)
        check_at_least(0, max_items=self.max_items)
        parse_augmentations(self.augment)
        self.training.check()
