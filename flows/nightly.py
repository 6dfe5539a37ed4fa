"""The nightly job: ingest what changed, then build a fresh index for that model and move `serving`."""

from __future__ import annotations

from prefect import flow

from flows.build_index import build_index
from flows.ingest import ingest
from imgest.encoders import DEFAULT_MODEL
from tasks.decode import DEFAULT_MAX_PIXELS


@flow(name="nightly", validate_parameters=True)
def nightly(catalogue: str, store: str, model: str = DEFAULT_MODEL, batch_size: str = "auto", device: str = "auto",
            shard_size: int = 2000, decode_workers: int = 2, max_pixels: int = DEFAULT_MAX_PIXELS,
            kind: str = "auto", memory: str = "4G", target_recall: float = 0.95, k: int = 10,
            alias: str | None = "serving") -> dict:
    summary = ingest(catalogue, store, model, batch_size, device, shard_size, decode_workers, max_pixels)
    index = build_index(store, summary["slug"], kind, memory, target_recall, k, alias=alias)
    return {"ingest": summary, "index": index}
