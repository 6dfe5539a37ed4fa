"""A shard's job: everything one encode-shard task needs besides its shard's plan, as one typed object that crosses
the task boundary (to a thread or a Dask worker): the spec, never a loaded model."""

from __future__ import annotations

from dataclasses import dataclass

from imgest.encoders import EncoderSpec
from imgest.names import DEFAULT_DTYPE
from imgest.state.lock import Fence
from imgest.tasks.ingest.batch_size import Encoding


@dataclass(frozen=True)
class ShardJob:
    spec: EncoderSpec
    device: str
    catalogue_url: str
    store_url: str
    batch_size: int
    decode_workers: int
    max_pixels: int
    encode_limit: str = "auto"
    fence: Fence | None = None  # the run's lock: checked before each shard's commit marker
    dtype: str = DEFAULT_DTYPE
    metadata_seq: int | None = None  # a caption model: the metadata snapshot whose texts it encodes
    runtime: str = "torch"
    precision: str | None = None  # None: the device's plain precision (nothing was measured)
    costs: tuple[float, float] | None = None  # measured decode and encode seconds per image, to size decoding
    decoder: str = "pillow"
    decode_side: int = 0  # the model's recorded decode side: JPEGs decode down to it (0: the whole image)
    keep_side: int = 0  # kept pixels: a copy of each image decoded, at this shorter side, in the shard's pixel file
    kept_source: str | None = None  # the model whose kept copies the planned items' kept_shard name

    @classmethod
    def of(cls, chosen: Encoding | None, **fields) -> ShardJob:
        """The job with what the run chose to encode with (runtime, precision, costs, decode); where nothing was
        measured (a caption model, or every row derived), torch at the device's plain precision, and Pillow."""
        if chosen is None:
            return cls(**fields)
        return cls(runtime=chosen.runtime, precision=chosen.precision, costs=chosen.costs(), decoder=chosen.decoder,
                   decode_side=chosen.decode_side, **fields)
