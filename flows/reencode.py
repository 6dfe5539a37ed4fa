"""Cold-start re-encode: the whole live catalogue with a new model into its own namespace, resumable."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.ingest import ingest
from flows.naming import run_name
from tasks.decode import DEFAULT_MAX_PIXELS
from tasks.report import render_reencode


@flow(name="reencode", flow_run_name=run_name("reencode"), validate_parameters=True)
def reencode(catalogue: str, store: str, model: str, batch_size: str = "auto", device: str = "auto",
             shard_size: int = 2000, decode_workers: int = 2, max_pixels: int = DEFAULT_MAX_PIXELS,
             runner: str = "local", workers: int = 0) -> dict:
    # An ingest into a namespace with no state encodes everything; killed, it resumes from committed shards.
    summary = ingest(catalogue, store, model, batch_size, device, shard_size, decode_workers, max_pixels,
                     runner=runner, workers=workers)
    create_markdown_artifact(render_reencode(summary), key="reencode-summary",
                             description=f"re-encode with {summary['model_id']}")
    return summary
