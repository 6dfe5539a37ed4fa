"""Cold-start re-encode: the whole live catalogue with a new model into its own namespace, resumable."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from imgest.config import IngestConfig
from imgest.defaults import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_DECODE_WORKERS,
    DEFAULT_DEVICE,
    DEFAULT_DTYPE,
    DEFAULT_MAX_PIXELS,
    DEFAULT_RUNNER,
    DEFAULT_SHARD_SIZE,
    DEFAULT_WORKERS,
)
from imgest.flows.ingest import ingest
from imgest.tasks.markdown import render_reencode
from imgest.tasks.run_names import run_name


@flow(name="reencode", flow_run_name=run_name("reencode"), validate_parameters=True)
def reencode(catalogue: str, store: str, model: str, batch_size: str = DEFAULT_BATCH_SIZE,
             device: str = DEFAULT_DEVICE, shard_size: int = DEFAULT_SHARD_SIZE,
             decode_workers: int = DEFAULT_DECODE_WORKERS, max_pixels: int = DEFAULT_MAX_PIXELS,
             runner: str = DEFAULT_RUNNER, workers: int = DEFAULT_WORKERS, dtype: str = DEFAULT_DTYPE) -> dict:
    cfg = IngestConfig(catalogue=catalogue, store=store, model=model, batch_size=batch_size, device=device,
                       shard_size=shard_size, decode_workers=decode_workers, max_pixels=max_pixels, runner=runner,
                       workers=workers, dtype=dtype)
    # An ingest into a namespace with no state encodes everything; killed, it resumes from committed shards.
    summary = ingest(**cfg.to_dict())
    create_markdown_artifact(render_reencode(summary), key="reencode-summary",
                             description=f"re-encode with {summary['model_id']}")
    return summary
