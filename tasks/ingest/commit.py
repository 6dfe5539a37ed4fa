"""Commit a run: fold its shard markers and deletions into the next snapshot, record the run summary."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from datetime import datetime

import pyarrow as pa

from imgest.encoders import EncoderSpec
from imgest.names import VERSION
from imgest.state import layout
from imgest.state.clock import now_iso
from imgest.state.committed import CatalogueState, read_marker, write_snapshot
from imgest.state.lock import Fence
from imgest.storage import Location
from imgest.tasks.ingest.plan import Plan
from imgest.tasks.ingest.writer import ShardResult


@dataclass
class RunSummary:
    run_id: str
    model_id: str
    slug: str
    catalogue: str
    store: str
    started: str
    finished: str = ""
    listed: int = 0
    skipped: int = 0
    new: int = 0
    changed: int = 0
    unchanged: int = 0
    deleted: int = 0
    rejected: int = 0  # failed ones included
    failed: int = 0  # of the rejected: transient reasons (timeout, throttling, memory), retried next run
    retried: int = 0  # failed last time, read again this run
    revived: int = 0  # came back with the bytes their tombstone had: old row live again, nothing encoded
    not_regular: int = 0  # FIFOs, devices, sockets, dangling links in the listing: skipped, never read
    encoded: int = 0
    derived: int = 0  # of the encoded: a head applied to stored base embeddings (nothing decoded)
    vanished: int = 0
    resumed_shards: int = 0  # committed by an earlier, interrupted run and folded in now
    shards: int = 0
    batch_size: int = 0
    batch_size_source: str = ""
    device: str = ""
    device_note: str | None = None  # --device auto on a host with a GPU it could not use: why (driver, CUDA build)
    runtime: str = ""  # what ran the encoder, and at which precision: the same for every shard of a run
    precision: str = ""
    encoding: dict | None = None  # how they were chosen: measured img/s per candidate, the refused, parity
    work_bound: float | None = None  # img/s the flow host's cores could make: cores / (decode + encode core-s)
    images_per_second: float = 0.0
    encode_seconds: float = 0.0  # summed over shards (busy time of all workers)
    encode_wall_seconds: float = 0.0  # first shard started to last shard done, as the flow saw it
    workers: list[str] = field(default_factory=list)  # host:pid of each process that encoded a shard
    seconds: float = 0.0
    snapshot_seq: int = 0
    projected_full_encode_hours: float = 0.0  # the whole listed catalogue at this run's images/s
    gpu_hours: float = 0.0
    parameters: dict = field(default_factory=dict)  # the flow's validated configuration
    imgest_version: str = ""
    rejected_items: list[tuple[str, str]] = field(default_factory=list)
    removed_orphans: list[str] = field(default_factory=list)
    metadata: dict | None = None  # --metadata: rows new/changed/removed, unknown items, images without a row
    kept_pixels: dict | None = None  # copies kept and read (tasks/ingest/kept.py KeptReport)
    texts: dict | None = None  # a text model: rows without text, rows for unlisted items, the snapshot read

    def to_dict(self) -> dict:
        return asdict(self)

    def record_encoding(self, encoding, results: list) -> None:
        """The runtime and precision the shards say they ran on (one pair: every worker loads the run's choice or
        fails its shard), and how it was chosen."""
        ran = sorted({(r.runtime, r.precision) for r in results if r.encoded - r.derived > 0})
        if ran:
            self.runtime, self.precision = ",".join(sorted({r for r, _ in ran})), ",".join(sorted({p for _, p in ran}))
        elif encoding is not None:
            self.runtime, self.precision = encoding.runtime, encoding.precision
        self.encoding = encoding.to_dict() if encoding is not None else None
        if encoding is not None:
            self.work_bound = encoding.work_bound(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                                  else os.cpu_count() or 1)


    def record_kept(self, report, results: list) -> None:
        """What the run kept and read of kept pixels (`report`: tasks/ingest/kept.py), with the shards' counts."""
        if report is None:
            return
        report.from_kept = sum(r.from_kept for r in results)
        report.from_catalogue = sum(r.encoded - r.derived - r.from_kept for r in results)
        report.written = sum(r.kept_written for r in results)
        report.bytes = sum(r.kept_bytes for r in results)
        report.faults = [f for r in results for f in r.kept_faults][:20]
        self.kept_pixels = report.to_dict()


def summary_key(run_id: str) -> str:
    return layout.run_summary_key(run_id)


def timeline_key(run_id: str) -> str:
    return layout.run_timeline_key(run_id)


def shard_timeline(results: list[ShardResult]) -> pa.Table:
    """One row per shard this run encoded: which worker, when, how long, what came out."""
    return pa.table({
        "shard": [r.shard for r in results],
        "worker": [r.worker for r in results],
        "started": pa.array([r.started or None for r in results], pa.string()).cast(pa.timestamp("us", tz="UTC")),
        "finished": pa.array([r.finished or None for r in results], pa.string()).cast(pa.timestamp("us", tz="UTC")),
        "seconds": pa.array([r.seconds for r in results], pa.float64()),
        "encode_seconds": pa.array([r.encode_seconds for r in results], pa.float64()),
        "wait_seconds": pa.array([r.wait_seconds for r in results], pa.float64()),
        "decode": pa.array([r.decode for r in results], pa.string()),
        "runtime": pa.array([r.runtime for r in results], pa.string()),
        "precision": pa.array([r.precision for r in results], pa.string()),
        "encoded": pa.array([r.encoded for r in results], pa.int64()),
        "rejected": pa.array([len(r.rejected) for r in results], pa.int64()),
        "bytes": pa.array([r.bytes for r in results], pa.int64()),
        "sha256": pa.array([r.sha256 for r in results], pa.string()),
    })


def commit_run(store: Location, state: CatalogueState, plan: Plan, results: list[ShardResult],
               summary: RunSummary, fence: Fence | None = None) -> RunSummary:
    """Shards are durable (their markers exist) before this runs; the snapshot is written last."""
    resumed = len(state.pending)
    for result in results:
        state.apply_commit(read_marker(store, state.slug, result.shard))
    state.delete(plan.deleted, plan.run_id, now_iso())
    touched = sum(r.unchanged for r in results)
    summary.listed, summary.skipped, summary.new = plan.listed, plan.skipped, plan.new
    summary.unchanged = plan.unchanged + touched
    summary.changed = plan.changed_candidates - touched
    summary.deleted = len(plan.deleted)
    summary.encoded = sum(r.encoded for r in results)
    summary.derived = sum(r.derived for r in results)
    summary.rejected_items = [rej for r in results for rej in r.rejected]
    summary.rejected = len(summary.rejected_items)
    summary.failed = sum(r.failed for r in results)
    summary.revived = sum(r.revived for r in results)
    summary.retried, summary.not_regular = plan.retried, plan.not_regular
    summary.vanished = sum(r.vanished for r in results)
    summary.shards = len(results)
    summary.resumed_shards = resumed
    summary.encode_seconds = round(sum(r.seconds for r in results), 3)
    summary.workers = sorted({r.worker for r in results if r.worker})
    # throughput of the whole encode phase: with N workers in parallel, wall time, not summed busy time
    elapsed = summary.encode_wall_seconds or summary.encode_seconds
    if elapsed:
        summary.images_per_second = round(summary.encoded / elapsed, 2)
    if summary.images_per_second:
        summary.projected_full_encode_hours = round(summary.listed / summary.images_per_second / 3600, 3)
    if summary.device.startswith("cuda"):
        summary.gpu_hours = round(summary.encode_seconds / 3600, 4)
    if fence is not None:
        fence.check(store)  # the snapshot is the run's commit: never written by a run that lost the lock
    if results or plan.deleted or resumed:
        counts = {k: v for k, v in summary.to_dict().items() if isinstance(v, int)}
        summary.snapshot_seq = write_snapshot(store, state, plan.run_id, counts)
    else:
        summary.snapshot_seq = state.seq
    summary.finished = now_iso()
    duration = datetime.fromisoformat(summary.finished) - datetime.fromisoformat(summary.started)
    summary.seconds = round(duration.total_seconds(), 3)  # not .seconds, which drops whole days
    if results:
        store.write_table(timeline_key(plan.run_id), shard_timeline(results))
    store.write_json(summary_key(plan.run_id), summary.to_dict())
    return summary


def new_summary(spec: EncoderSpec, run_id: str, catalogue: str, store: str, parameters: dict) -> RunSummary:
    from imgest.storage import redact

    parameters = {k: redact(v) if isinstance(v, str) else v for k, v in parameters.items()}
    return RunSummary(run_id=run_id, model_id=spec.model_id, slug=spec.slug, catalogue=redact(catalogue),
                      store=redact(store), started=now_iso(), parameters=parameters,
                      imgest_version=VERSION)
