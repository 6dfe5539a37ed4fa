"""Cold-start re-encode: the whole live catalogue with a new model into its own namespace, resumable."""

from __future__ import annotations

from prefect.artifacts import create_markdown_artifact

from imgest.config import IngestConfig, ReencodeConfig
from imgest.config.flow_params import configured_flow
from imgest.flows.ingest import ingest
from imgest.reports.ingest import render_reencode
from imgest.reports.run_names import run_name


@configured_flow(name="reencode", flow_run_name=run_name("reencode"))
def reencode(config: ReencodeConfig) -> dict:
    # An ingest into a namespace with no state encodes everything; killed, it resumes from committed shards.
    summary = ingest(IngestConfig(**config.model_dump()))
    create_markdown_artifact(render_reencode(summary), key="reencode-summary",
                             description=f"re-encode with {summary['model_id']}")
    return summary
