"""One configuration model per flow: each field's type, default, help and check written once.

A flow takes its model as its one parameter (Prefect renders it as a form and validates it at the API); the
CLI derives its options from it (`imgest/cli/options.py`), the deployments set what differs, and
docs/configuration.md is generated from it. A bad value fails before any work in one line naming the field
and what is allowed. Credentials are never a field: a URL carrying one is refused before it can reach run
parameters, logs or artifacts."""

from __future__ import annotations

from typing import Annotated, Self

from pydantic import AfterValidator, BeforeValidator, Field, field_validator, model_validator

from imgest.config.base import FlowConfig
from imgest.config.fields import (
    MODEL_NAMES,
    OWN_MODEL,
    BatchSize,
    Catalogue,
    Cli,
    Decoder,
    DecodeWorkers,
    Device,
    Disk,
    Dtype,
    ForceDecoder,
    KeepPixels,
    Kind,
    MaxPixels,
    Memory,
    Model,
    OptionalUrl,
    Precision,
    RecallK,
    Runner,
    Runtime,
    ShardSize,
    Store,
    StoreModel,
    TargetRecall,
    Workers,
    alias_name,
    at_least,
    comma_ints,
    cut_offs,
    decoder_choice,
    encode_limit_name,
    fraction,
    no_credentials,
    non_negative,
    not_empty,
    one_of,
    parse_batch_size,
    workers_need_dask,
)
from imgest.config.heads import TrainHeadConfig
from imgest.names import (
    ACTIONS,
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
    DEFAULT_PRECISION,
    DEFAULT_RECALL_QUERIES,
    DEFAULT_RESAMPLES,
    DEFAULT_RETAIN_DAYS,
    DEFAULT_RETRAIN_SHARE,
    DEFAULT_RUNNER,
    DEFAULT_RUNTIME,
    DEFAULT_SHARD_SIZE,
    DEFAULT_TARGET_RECALL,
    DEFAULT_WORKERS,
)


def _targets(value: object) -> tuple[str, ...]:
    """Sync targets: one URL or several; none carrying credentials (the full URL check is the sync's own)."""
    from imgest.redact import redact_url, url_secrets

    values = (value,) if isinstance(value, str) else tuple(value or ())
    for url in values:
        if not isinstance(url, str) or not url.strip():
            raise ValueError("sync_to must be target URLs (milvus://, qdrant://, lancedb://)")
        if found := url_secrets(url):
            raise ValueError(f"sync_to {redact_url(url)} is refused: it carries {', '.join(found)}; credentials come "
                             "from the environment (MILVUS_TOKEN, QDRANT_API_KEY, AWS_*)")
    return values


SyncTargets = Annotated[tuple[str, ...], BeforeValidator(_targets), Cli("--sync-to", list[str])]


Inventory = Annotated[OptionalUrl, Field(
    description="An S3 Inventory report's manifest.json (CSV, Parquet or ORC) to list the catalogue from instead "
                "of LIST: s3://inventory-bucket/.../manifest.json")]


def inventory_lists_s3(config):
    """An inventory lists an S3 bucket, from its report's manifest."""
    if config.inventory and not (config.catalogue or "").startswith(("s3://", "s3a://")):
        raise ValueError(f"inventory: an S3 Inventory lists an S3 bucket; the catalogue is {config.catalogue}")
    if config.inventory and not config.inventory.endswith("manifest.json"):
        raise ValueError(f"inventory must be the URL of a report's manifest.json; got {config.inventory}")
    return config


# -- one configuration per flow ----------------------------------------------------------------------------
class EncodeConfig(FlowConfig):
    """What every encode of a catalogue into a store takes (ingest and reencode)."""

    catalogue: Catalogue
    store: Store
    model: Annotated[StoreModel, Field(
        description=f"{MODEL_NAMES}; {OWN_MODEL}, {DEFAULT_MODEL} for an empty store")] = None
    batch_size: BatchSize = DEFAULT_BATCH_SIZE
    device: Device = DEFAULT_DEVICE
    runtime: Runtime = DEFAULT_RUNTIME
    precision: Precision = DEFAULT_PRECISION
    shard_size: ShardSize = DEFAULT_SHARD_SIZE
    decode_workers: DecodeWorkers = DEFAULT_DECODE_WORKERS
    max_pixels: MaxPixels = DEFAULT_MAX_PIXELS
    runner: Runner = DEFAULT_RUNNER
    workers: Workers = DEFAULT_WORKERS
    dtype: Dtype = DEFAULT_DTYPE
    decoder: Decoder = None
    force_decoder: ForceDecoder = None
    keep_pixels: KeepPixels = None

    @model_validator(mode="after")
    def _workers_need_dask(self) -> Self:
        return decoder_choice(workers_need_dask(self))

    @property
    def fixed_batch_size(self) -> int | None:
        return parse_batch_size(self.batch_size)


class ReencodeConfig(EncodeConfig):
    """reencode: the whole catalogue into a new model's namespace (resumable)."""

    model: Annotated[Model, Field(description="The new model: efficientnet-lite0 or hf:<hub id or local folder>")]
    inventory: Inventory = None

    @model_validator(mode="after")
    def _inventory_lists_s3(self) -> Self:
        return inventory_lists_s3(self)


class IngestConfig(EncodeConfig):
    """ingest: encode what is new or changed in the catalogue; tombstone what was deleted."""

    encode_limit: Annotated[str, AfterValidator(encode_limit_name), Field(
        description="Prefect global concurrency limit each encode holds a slot of: auto (one encode per GPU at a "
                    "time; none on CPU), none, or a name")] = DEFAULT_ENCODE_LIMIT
    max_bytes: Annotated[int, AfterValidator(at_least(1)), Field(
        description="Larger objects are rejected from their listing size, never read")] = DEFAULT_MAX_BYTES
    max_delete_fraction: Annotated[float, AfterValidator(fraction()), Field(
        description="A run that would tombstone more than this share of the live items stops before writing "
                    "anything (exit 2)")] = DEFAULT_MAX_DELETE_FRACTION
    allow_mass_delete: Annotated[bool, Field(description="The deletions are real: lift max_delete_fraction")] = False
    metadata: Annotated[OptionalUrl, Field(
        description="Catalogue metadata, one row per item_id (Parquet, CSV or JSONL: item_id, product_id, title, "
                    "caption, attributes): stored with the run; text models such as minilm-l6 embed its text")] = None
    inventory: Inventory = None

    @model_validator(mode="after")
    def _inventory_lists_s3(self) -> Self:
        return inventory_lists_s3(self)

    @property
    def delete_limit(self) -> float | None:
        """The fraction of live items a run may tombstone; None when allow_mass_delete lifts it."""
        return None if self.allow_mass_delete else self.max_delete_fraction


class IndexConfig(FlowConfig):
    """build-index: a verified index version of one model, its aliases moved."""

    store: Store
    model: Annotated[StoreModel, Field(description=f"Model name, model id or slug in the store; {OWN_MODEL}")] = None
    kind: Kind = DEFAULT_KIND
    memory: Memory = DEFAULT_MEMORY
    target_recall: TargetRecall = DEFAULT_TARGET_RECALL
    k: RecallK = DEFAULT_K
    queries: Annotated[int, AfterValidator(at_least(1)), Field(
        description="Held-out corpus queries measuring the recall")] = DEFAULT_RECALL_QUERIES
    disk: Disk = DEFAULT_DISK
    alias: Annotated[str | None, AfterValidator(alias_name), Field(
        description="Alias to move once verified: 'auto' moves the aliases already on this model (creating "
                    "`serving` if the store has none); a name; '' for none")] = DEFAULT_ALIAS
    parts: Annotated[int, AfterValidator(at_least(1)), Field(
        description="IVF and flat indexes: train once, add this many slices in parallel on runner, merge "
                    "(faiss merge_from); 1: one process")] = DEFAULT_INDEX_PARTS
    runner: Runner = DEFAULT_RUNNER
    workers: Workers = DEFAULT_WORKERS
    rebuild: Annotated[bool, Field(
        description="Train a new version from scratch even when nothing changed since the last one (otherwise "
                    "it is reused) or an IVF version could be updated in place")] = False
    retrain_share: Annotated[float, AfterValidator(non_negative(" (0: retrain on any addition)")), Field(
        description="Update an IVF version in place until this share of its training count was added since; "
                    "then train anew")] = DEFAULT_RETRAIN_SHARE

    @model_validator(mode="after")
    def _workers_need_dask(self) -> Self:
        return workers_need_dask(self)


class NightlyConfig(IngestConfig):
    """nightly: an ingest and an index build per model, both validated before either starts."""

    model: Annotated[str | None, Field(
        description="Default: the models the store's aliases point at (serving; both models in a migration "
                    "window), efficientnet-lite0 for a new store. A model named here is ingested too, unless "
                    "retired")] = None
    kind: Kind = DEFAULT_KIND
    memory: Memory = DEFAULT_MEMORY
    target_recall: TargetRecall = DEFAULT_TARGET_RECALL
    k: RecallK = DEFAULT_K
    index_parts: Annotated[int, AfterValidator(at_least(1)), Field(
        description="IVF and flat indexes: add this many slices in parallel on runner, merge")] = DEFAULT_INDEX_PARTS
    disk: Disk = DEFAULT_DISK
    report_duplicates: Annotated[bool, Field(description="After the builds, report duplicate groups, new ones")] = False
    sync_to: Annotated[SyncTargets, Field(
        description="After the builds, sync the serving model to this vector database (repeat it for several; "
                    "during a migration window the other model too, into its own collection): milvus://..., "
                    "qdrant://..., lancedb://... as imgest sync --to takes")] = ()

    def ingest(self, model: str) -> IngestConfig:
        return IngestConfig(**{**self.model_dump(include=set(IngestConfig.model_fields)), "model": model})

    def index(self, model: str) -> IndexConfig:
        # alias "auto": each rebuilt index moves the aliases already on its model (serving, shadow, previous)
        return IndexConfig(store=self.store, model=model, kind=self.kind, memory=self.memory,
                           target_recall=self.target_recall, k=self.k, alias=DEFAULT_ALIAS, parts=self.index_parts,
                           runner=self.runner, workers=self.workers, disk=self.disk)


class MigrateConfig(FlowConfig):
    """migrate: one window action; `start` re-encodes and builds the new model's index as `shadow`."""

    store: Store
    action: Annotated[str, AfterValidator(one_of(ACTIONS)), Field(
        description=f"The window action: {', '.join(ACTIONS)}")] = "status"
    to: Annotated[str | None, Field(description="start: the new model")] = None
    catalogue: Annotated[OptionalUrl, Field(
        description="start: the catalogue to re-encode; default: the serving model's last one")] = None
    inventory: Annotated[OptionalUrl, Field(
        description="start: an S3 Inventory report's manifest.json to list the catalogue from instead of LIST "
                    "(with --catalogue s3://...)")] = None
    gate: Annotated[dict | None, Field(
        description="promote: an `imgest eval --alias serving --compare shadow --json` report made elsewhere; "
                    "recorded in the window as its evaluation")] = None
    margin: Annotated[float, AfterValidator(non_negative(" (the drop of the metric allowed)")), Field(
        description="promote: allowed drop of shadow's metric below serving's")] = 0.0
    force: Annotated[str | None, Field(
        description="promote: without (or against) the evaluation; the reason is recorded in the window and the "
                    "alias history")] = None
    min_shadow_agreement: Annotated[float | None, AfterValidator(fraction()), Field(
        description="promote: also require shadow traffic (imgest api --shadow-share) to agree with serving at "
                    "least this much (mean overlap@k, 0-1)")] = None
    retain_days: Annotated[float, AfterValidator(non_negative()), Field(
        description="finish: keep the retired model's data this long")] = DEFAULT_RETAIN_DAYS
    sync_to: Annotated[SyncTargets, Field(
        description="promote, rollback: also switch this vector database's collection alias (or LanceDB table) to "
                    "the model now serving, as the nightly --sync-to would (repeat it for each target the nightly "
                    "syncs to)")] = ()
    batch_size: BatchSize = DEFAULT_BATCH_SIZE
    device: Device = DEFAULT_DEVICE
    runtime: Runtime = DEFAULT_RUNTIME
    precision: Precision = DEFAULT_PRECISION
    kind: Kind = DEFAULT_KIND
    memory: Memory = DEFAULT_MEMORY
    target_recall: TargetRecall = DEFAULT_TARGET_RECALL
    shard_size: ShardSize = DEFAULT_SHARD_SIZE
    disk: Disk = DEFAULT_DISK
    decoder: Annotated[Decoder, Field(description="start: the new model's JPEG decoder (default: simplejpeg, every "
                                                  "model's, recorded on its first run)")] = None
    force_decoder: ForceDecoder = None
    keep_pixels: Annotated[KeepPixels, Field(description="start: keep resized copies of the images the new model "
                                                         "decodes (SIDE; 0: off); default: as the serving model "
                                                         "keeps them")] = None

    @model_validator(mode="after")
    def _start_needs_a_model(self) -> Self:
        decoder_choice(self)
        if self.action == "start" and not (self.to or "").strip():
            raise ValueError("to must not be empty")
        if self.force is not None and not self.force.strip():
            raise ValueError("force needs a reason (it is recorded in the window and the alias history)")
        if self.inventory and not self.catalogue:
            raise ValueError("inventory: name the bucket it lists with catalogue (s3://bucket/prefix)")
        return inventory_lists_s3(self)


class EvalConfig(FlowConfig):
    """eval: a labelled query set against one alias, or two compared; candidate models weighed against its model."""

    store: Store
    queries: Annotated[str, AfterValidator(not_empty), AfterValidator(no_credentials), Field(
        description="Query set (JSONL or Parquet): query_id, image|text, relevant, class")]
    alias: Annotated[str, AfterValidator(alias_name), Field(description="Retriever A (an alias)")] = "serving"
    compare: Annotated[str | None, AfterValidator(alias_name), Field(
        description="Retriever B (an alias), for win/loss, bootstrap, fusion")] = None
    ks: Annotated[tuple[int, ...], BeforeValidator(comma_ints), AfterValidator(cut_offs), Cli("--k", str), Field(
        description="Cut-offs, e.g. 1,5,10")] = DEFAULT_KS
    resamples: Annotated[int, AfterValidator(at_least(1)), Field(
        description="Paired bootstrap resamples (>= 1000 recommended)")] = DEFAULT_RESAMPLES
    seed: Annotated[int, Field(description="Bootstrap seed")] = 0
    out: Annotated[OptionalUrl, Field(
        description="Folder for eval.json, eval.md, PNG plots and, with compare, routing.json (what search "
                    "--route serves)")] = None
    device: Device = DEFAULT_DEVICE
    traffic: Annotated[OptionalUrl, Field(
        description="A query log's class counts (JSON {class: n} or JSONL with 'class'): the traffic-weighted "
                    "gain of the compared retriever")] = None
    candidates: Annotated[tuple[str, ...], Cli("--candidates", str), Field(
        description="Image models (registered names) weighed against the alias's model, e.g. "
                    "efficientnet-lite0-gem,efficientnet-lite1: recall on a sample of the catalogue, the paired "
                    "interval against the alias's model, encode ms per image here, hours at the catalogue's size")] = ()
    candidate_sample: Annotated[int, AfterValidator(at_least(1)), Field(
        description="Live items drawn (seeded) beside the queries' relevant ones, which every candidate and the "
                    "alias's model encode and search exactly")] = 2000
    catalogue: Annotated[OptionalUrl, Field(
        description="With candidates: the catalogue the store was ingested from, to read the sample's images "
                    "(default: the root the store recorded)")] = None

    @field_validator("candidates", mode="before")
    @classmethod
    def _comma_names(cls, value: object) -> object:
        return tuple(v.strip() for v in value.split(",") if v.strip()) if isinstance(value, str) else value

    @field_validator("candidates")
    @classmethod
    def _image_models(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        from imgest import encoders

        for name in value:
            try:
                spec = encoders.resolve(name)
            except encoders.EncoderError as exc:
                raise ValueError(f"candidates: {exc}") from None
            if "image" not in spec.modalities:
                raise ValueError(f"candidates: {name} is a text model over captions; candidates are image models")
        return value

    @model_validator(mode="after")
    def _traffic_needs_compare(self) -> Self:
        if self.traffic and not self.compare:
            raise ValueError("traffic needs compare: the gain is that of adding the compared retriever")
        return self


class SyncConfig(FlowConfig):
    """sync: a vector database (Milvus, Qdrant, LanceDB) brought in step with one model's live items."""

    store: Store
    to: Annotated[str, AfterValidator(not_empty), Field(
        description="The target: milvus://HOST:PORT/COLLECTION, milvus:///path/db.db/COLLECTION (Milvus Lite), "
                    "qdrant://HOST:PORT/COLLECTION, qdrant:///path/folder/COLLECTION (local mode), "
                    "lancedb://PATH_OR_URL/TABLE; never credentials (MILVUS_TOKEN, QDRANT_API_KEY, AWS_*)")]
    alias: Annotated[str, AfterValidator(not_empty), Field(
        description="Sync the model this alias serves (ignored with --model)")] = "serving"
    model: Annotated[str | None, Field(description="Sync this model (name, model id or slug) instead of an "
                                                   "alias's")] = None
    batch: Annotated[int, AfterValidator(at_least(1)), Field(
        description="Rows per upsert or delete call to the target")] = 1000


class DuplicatesConfig(FlowConfig):
    """duplicates: exact and near-duplicate groups of one image model's live items."""

    store: Store
    alias: Annotated[str | None, AfterValidator(alias_name), Field(
        description="Alias of the image model whose index is searched")] = "serving"
    model: Annotated[str | None, Field(description="This model's latest index instead of an alias")] = None
    threshold: Annotated[Annotated[float, AfterValidator(fraction(low_open=True))] | None, Field(
        description="Cosine at or above which two images are near-duplicates (none: the model's threshold "
                    f"calibrated on this catalogue; {DEFAULT_DUPLICATE_THRESHOLD} when none can be measured)")] = None
    calibrate: Annotated[bool, Field(
        description="Measure the calibrated threshold again now (it is reused until the model or the catalogue "
                    "changes much)")] = False
    calibration_sample: Annotated[int, AfterValidator(at_least(8)), Field(
        description="Live images the calibration copies and embeds (each in every way a catalogue copies "
                    "one)")] = 100
    calibration_recall: Annotated[float, Field(gt=0, le=1, description="Share of the planted copies the "
                                               "calibrated threshold must find")] = 0.95


CONFIGS = {"ingest": IngestConfig, "reencode": ReencodeConfig, "build-index": IndexConfig,
           "nightly": NightlyConfig, "migrate": MigrateConfig, "eval": EvalConfig, "duplicates": DuplicatesConfig,
           "train-head": TrainHeadConfig}  # flow name -> its model (docs/configuration.md is generated from it)
