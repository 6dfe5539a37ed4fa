"""The configuration of train-head: how a head (or a whitening) is fitted, and where its data comes from."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

from imgest.config.base import ConfigError, FlowConfig
from imgest.config.fields import (
    OWN_MODEL,
    Cli,
    Device,
    OptionalUrl,
    Store,
    StoreModel,
    at_least,
    augmentations,
    non_negative,
    one_of,
    optional,
    shrinkage_value,
)
from imgest.names import AUGMENTATIONS, DEFAULT_DEVICE, DEFAULT_VIEWS, LOSSES, SELF_SUPERVISED_ITEMS


class HeadConfig(FlowConfig):
    """How a head trains: loss, dimensions, P x K batches, early stopping."""

    loss: Annotated[str, AfterValidator(one_of(LOSSES)), Field(
        description="triplet (semi-hard mining), infonce (NT-Xent) or proxynca")] = "infonce"
    head_type: Annotated[str, AfterValidator(one_of(("residual", "mlp", "whiten"))), Field(
        description="residual (starts as the identity: the untrained head is the base), mlp (a new space of "
                    "dim_out dimensions) or whiten (learned whitening, no labels: `train-head --whiten`)")] = "residual"
    dim_out: Annotated[int, AfterValidator(at_least(0)), Cli("--dim"), Field(
        description="Output dimension of an mlp or whitening head (0: the base model's)")] = 0
    shrinkage: Annotated[str, AfterValidator(shrinkage_value), Field(
        description="Whitening: how far the eigenvalues of the covariance it whitens by are pulled to their mean, "
                    "0-1, or auto (Ledoit-Wolf)")] = "0.5"
    sample: Annotated[int, AfterValidator(at_least(1)), Field(
        description="Whitening: live vectors it is fitted on at most (a seeded sample)")] = 100_000
    pair_images: Annotated[int, AfterValidator(at_least(0)), Field(
        description="Whitening: catalogue images (a seeded sample) whose augmented views, --views of each, make "
                    "the (image, view) pairs it learns what a re-shoot changes from (0: whiten by the live "
                    "vectors' own covariance, reading no image)")] = 1000
    hidden: Annotated[int, AfterValidator(at_least(1)), Field(description="Hidden width")] = 1024
    epochs: Annotated[int, AfterValidator(at_least(1)), Field(
        description="Most epochs; early stopping on held-out recall@1 usually ends sooner")] = 50
    labels_per_batch: Annotated[int, AfterValidator(at_least(1)), Field(description="P of the P x K batches")] = 32
    items_per_label: Annotated[int, AfterValidator(at_least(2)), Field(
        description="K of the P x K batches (>= 2: each anchor needs a positive)")] = 4
    lr: Annotated[float, Field(ge=0, description="AdamW learning rate (proxies: 10x; 0: the head stays as "
                                                 "initialised)")] = 1e-3
    weight_decay: Annotated[float, Field(ge=0, description="AdamW weight decay")] = 1e-4
    margin: Annotated[float, Field(ge=0, description="Triplet margin (squared distance of unit vectors)")] = 0.2
    temperature: Annotated[float, Field(gt=0, description="InfoNCE temperature")] = 0.1
    proxy_scale: Annotated[float, Field(gt=0, description="ProxyNCA distance scale")] = 3.0
    keep: Annotated[float, AfterValidator(non_negative()), Field(
        description="Weight of the term keeping each item's base neighbourhood (0: off)")] = 1.0
    keep_temperature: Annotated[float, Field(gt=0, description="Temperature of the keep term")] = 0.05
    hard_negatives: Annotated[int, AfterValidator(at_least(0)), Field(
        description="Base-space neighbour labels each label brings into its batch (0: random batches)")] = 3
    val_fraction: Annotated[float, Field(gt=0, lt=1, description="Share held out for validation and evaluation")] = 0.2
    split: Annotated[str, AfterValidator(one_of(("items", "labels"))), Field(
        description="items: held-out items of every label; labels: held-out labels (unseen classes)")] = "items"
    patience: Annotated[int, AfterValidator(at_least(1)), Field(
        description="Epochs without a better held-out recall@1 before stopping")] = 5
    seed: Annotated[int, Field(description="Seed of the split, the batches and the initial weights")] = 0

    def out_dim(self, dim_in: int) -> int:
        if self.head_type == "residual" and self.dim_out not in (0, dim_in):
            raise ConfigError(f"a residual head keeps the base dimension {dim_in}; got dim_out {self.dim_out} "
                              "(use head_type mlp for another dimension)")
        return self.dim_out or dim_in


class TrainHeadConfig(FlowConfig):
    """train-head: where the base embeddings are, the labels (or augmented views), and the training."""

    store: Annotated[Store, Field(description="Folder or URL of the store holding the base model's embeddings")]
    base_model: Annotated[StoreModel, Field(
        description=f"Base model: name, model id or slug in the store; {OWN_MODEL}")] = None
    labels: Annotated[OptionalUrl, Field(
        description="CSV with header item_id,label (instance or class), or JSONL; without it, each item is its "
                    "own label with augmented views as positives")] = None
    views: Annotated[int, AfterValidator(at_least(1)), Field(
        description="Without labels: augmented views per catalogue image (encoded once)")] = DEFAULT_VIEWS
    max_items: Annotated[int | None, AfterValidator(optional(at_least(0))), Field(
        description="At most this many items train: a seeded sample of the labelled live items (default: all), "
                    f"or without labels of the catalogue items (default: {SELF_SUPERVISED_ITEMS:,}; each is "
                    "decoded and encoded once per view); 0: all")] = None
    augment: Annotated[str, AfterValidator(augmentations), Field(
        description="Without labels: the augmentations making the views: all, or a comma list of "
                    f"{', '.join(AUGMENTATIONS)}, or of the groups geometry, photometry, rendering")] = "all"
    eval_queries: Annotated[OptionalUrl, Field(
        description="A labelled query set in `imgest eval`'s format (e.g. real query photos): epochs are selected "
                    "on it and the report gives base vs head on it with a paired bootstrap interval")] = None
    negatives: Annotated[int, AfterValidator(at_least(0)), Field(
        description="With eval_queries: live items besides the training set's and those the queries name that the "
                    "queries are searched among (a seeded sample of shards, rows within them; all of them when "
                    "fewer)")] = 100_000
    catalogue: Annotated[OptionalUrl, Field(
        description="The catalogue the base model was ingested from (checked against the one recorded at "
                    "ingest); images are read only under it. Default: the recorded one, when it is on the store's "
                    "kind of storage")] = None
    device: Annotated[Device, Field(description="Where eval_queries images are encoded: auto, cpu, cuda")] = \
        DEFAULT_DEVICE
    training: HeadConfig = HeadConfig()
