"""Commands: ingest, status, export, reencode, nightly, demo."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Optional

import typer

from imgest.cli import _fail, _user_errors, app
from imgest.defaults import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_DECODE_WORKERS,
    DEFAULT_DEVICE,
    DEFAULT_DISK,
    DEFAULT_DTYPE,
    DEFAULT_ENCODE_LIMIT,
    DEFAULT_KIND,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_DELETE_FRACTION,
    DEFAULT_MAX_PIXELS,
    DEFAULT_MEMORY,
    DEFAULT_MODEL,
    DEFAULT_RUNNER,
    DEFAULT_SHARD_SIZE,
    DEFAULT_TARGET_RECALL,
    DEFAULT_WORKERS,
)
from imgest.progress import reporting

MAX_BYTES = typer.Option(DEFAULT_MAX_BYTES, help="Larger objects are rejected from their listing size, never read")
MAX_DELETE = typer.Option(DEFAULT_MAX_DELETE_FRACTION, help="A run that would tombstone more than this share of "
                                                            "the live items stops before writing anything (exit 2)")
ALLOW_MASS_DELETE = typer.Option(False, "--allow-mass-delete", help="The deletions are real: lift "
                                                                      "--max-delete-fraction for this run")
DTYPE = typer.Option(DEFAULT_DTYPE, help="Vectors in the shards this run writes: float32 or float16 (half the "
                                         "bytes; indexes, export, eval and heads read both)")
RUNNER = typer.Option(DEFAULT_RUNNER, help="Where shards encode: local (this process), dask (a local Dask cluster "
                                           "of worker processes) or a Dask scheduler address tcp://host:8786")
METADATA = typer.Option(None, help="Catalogue metadata, one row per item_id (Parquet, CSV or JSONL: item_id, "
                                   "product_id, title, caption, attributes): stored with the run; text models "
                                   "such as minilm-l6 embed its text")
INVENTORY = typer.Option(None, help="An S3 Inventory report's manifest.json (CSV, Parquet or ORC) to list the "
                                    "catalogue from instead of LIST: s3://inventory-bucket/.../manifest.json")
WORKERS = typer.Option(DEFAULT_WORKERS, help="Worker processes of a local Dask cluster (--runner dask); 0: one per "
                                             "CPU core")


@app.command()
def ingest(
    catalogue: str = typer.Option(..., help="Folder or URL of the catalogue: /path, file://, s3://bucket/prefix"),
    store: str = typer.Option(..., help="Folder or URL where shards and state are kept"),
    model: str = typer.Option(DEFAULT_MODEL, help="efficientnet-lite0 or hf:<hub id or local folder>"),
    batch_size: str = typer.Option(DEFAULT_BATCH_SIZE, help="'auto' (measured, cached per model and device) or N"),
    device: str = typer.Option(DEFAULT_DEVICE, help="auto, cpu, cuda or cuda:N"),
    shard_size: int = typer.Option(DEFAULT_SHARD_SIZE, help="Images per shard (one Prefect task per shard)"),
    decode_workers: int = typer.Option(DEFAULT_DECODE_WORKERS, help="Workers reading and decoding ahead of the "
                                                                    "encoder; 0: sized from the cores left to it"),
    max_pixels: int = typer.Option(DEFAULT_MAX_PIXELS, help="Larger images are rejected as decompression bombs"),
    runner: str = RUNNER,
    workers: int = WORKERS,
    encode_limit: str = typer.Option(DEFAULT_ENCODE_LIMIT, help="Prefect global concurrency limit each encode "
                                                                "holds a slot of: auto (one encode per GPU at a "
                                                                "time; none on CPU), none, or a name"),
    max_bytes: int = MAX_BYTES,
    max_delete_fraction: float = MAX_DELETE,
    allow_mass_delete: bool = ALLOW_MASS_DELETE,
    dtype: str = DTYPE,
    metadata: Optional[str] = METADATA,
    inventory: Optional[str] = INVENTORY,
    as_json: bool = typer.Option(False, "--json", help="Print the run summary as JSON"),
) -> None:
    """Encode what is new or changed in the catalogue; tombstone what was deleted."""
    try:
        from imgest import encoders
        from imgest.config import IngestConfig
        from imgest.storage import open_location
        from imgest.tasks.listing import check_apart

        # Fail on bad input before Prefect starts its server: a one-line reason, exit 2.
        cfg = IngestConfig(catalogue=catalogue, store=store, model=model, batch_size=batch_size, device=device,
                           shard_size=shard_size, decode_workers=decode_workers, max_pixels=max_pixels,
                           runner=runner, workers=workers, encode_limit=encode_limit, max_bytes=max_bytes,
                           max_delete_fraction=max_delete_fraction, allow_mass_delete=allow_mass_delete,
                           dtype=dtype, metadata=metadata, inventory=inventory)
        encoders.resolve(cfg.model)
        encoders.resolve_device(cfg.device)
        check_apart(open_location(cfg.catalogue, must_exist=True, what="catalogue"), open_location(cfg.store))

        from imgest.flows.ingest import ingest as ingest_flow
        from imgest.tasks.commit import RunSummary
        from imgest.tasks.markdown import render_summary

        with reporting():
            summary = ingest_flow(**cfg.to_dict())
    except _user_errors() as exc:
        _fail(exc)
    if as_json:
        typer.echo(json.dumps(summary, indent=2, default=str))
    else:
        typer.echo(render_summary(RunSummary(**summary)))


@app.command()
def status(
    store: str = typer.Option(..., help="Folder or URL of the store"),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output (keys in docs/evaluation.md)"),
) -> None:
    """Per model: live items, shards, rejected items with reasons, tombstones, last run."""
    from imgest.tasks.status import store_status

    try:
        report = store_status(store)
    except _user_errors() as exc:
        _fail(exc)
    if as_json:
        typer.echo(json.dumps(report, indent=2, default=str))
        return
    typer.echo(f"store: {report['store']}")
    if report["running"]:
        typer.echo(f"running: {report['running']['owner']} since {report['running']['started']}")
    if not report["models"]:
        typer.echo("no models ingested yet")
    for m in report["models"]:
        last = m["last_run"] or {}
        typer.echo(f"\nmodel {m['name']} ({m['slug']}), dim {m['dim']}\n  model id: {m['model_id']}")
        typer.echo(f"  live {m['live']} in {m['shards']} shard(s), rejected {len(m['rejected'])}, "
                   f"tombstones {m['tombstones']}, snapshot {m['snapshot']}, pending shards {m['pending_shards']}")
        if last:
            typer.echo(f"  last run {last.get('run_id')} finished {last.get('finished')}: encoded "
                       f"{last.get('encoded')}, {last.get('images_per_second')} img/s")
        for rej in m["rejected"]:
            typer.echo(f"  rejected {rej['item_id']}: {rej['reason']}")


@app.command()
def export(
    store: str = typer.Option(..., help="Folder or URL of the store"),
    model: str = typer.Option(..., help="Model name, model id or slug as shown by `imgest status`"),
    out: str = typer.Option(..., help="Output Parquet file (local path or URL)"),
) -> None:
    """Write the live embeddings of one model, one row per live item, as a Parquet file."""
    from imgest.tasks.export import export_live

    try:
        result = export_live(store, model, out)
    except _user_errors() as exc:
        _fail(exc)
    typer.echo(f"exported {result['rows']} live embeddings of {result['model_id']} to {result['out']}")


@app.command()
def reencode(
    catalogue: str = typer.Option(..., help="Folder or URL of the catalogue"),
    store: str = typer.Option(..., help="Folder or URL of the store"),
    model: str = typer.Option(..., help="The new model: efficientnet-lite0 or hf:<hub id or local folder>"),
    batch_size: str = typer.Option(DEFAULT_BATCH_SIZE, help="'auto' or N"),
    device: str = typer.Option(DEFAULT_DEVICE, help="auto, cpu, cuda or cuda:N"),
    runner: str = RUNNER,
    workers: int = WORKERS,
    dtype: str = DTYPE,
) -> None:
    """Encode the whole catalogue with a new model into its own namespace (resumable; old data untouched)."""
    try:
        from imgest import encoders
        from imgest.config import IngestConfig
        from imgest.storage import open_location

        cfg = IngestConfig(catalogue=catalogue, store=store, model=model, batch_size=batch_size, device=device,
                           runner=runner, workers=workers, dtype=dtype)
        encoders.resolve(cfg.model)
        open_location(cfg.catalogue, must_exist=True, what="catalogue")
        from imgest.flows.reencode import reencode as reencode_flow
        from imgest.tasks.markdown import render_reencode

        with reporting():
            summary = reencode_flow(catalogue=cfg.catalogue, store=cfg.store, model=cfg.model,
                                    batch_size=cfg.batch_size, device=cfg.device, runner=cfg.runner,
                                    workers=cfg.workers, dtype=cfg.dtype)
    except _user_errors() as exc:
        _fail(exc)
    typer.echo(render_reencode(summary))


@app.command()
def nightly(
    catalogue: str = typer.Option(..., help="Folder or URL of the catalogue"),
    store: str = typer.Option(..., help="Folder or URL of the store"),
    model: Optional[str] = typer.Option(None, help="Default: the models the store's aliases point at (serving; "
                                                    "both models in a migration window), efficientnet-lite0 for a "
                                                    "new store. A model named here is ingested too, unless retired"),
    batch_size: str = typer.Option(DEFAULT_BATCH_SIZE, help="'auto' or N"),
    device: str = typer.Option(DEFAULT_DEVICE, help="auto, cpu, cuda or cuda:N"),
    kind: str = typer.Option(DEFAULT_KIND, help="Index kind or faiss factory string"),
    memory: str = typer.Option(DEFAULT_MEMORY, help="Memory budget for the index"),
    disk: str = typer.Option(DEFAULT_DISK, help="Local disk for a PQ index's float16 re-rank vectors: "
                             "'unlimited', 0 or e.g. 20G"),
    target_recall: float = typer.Option(DEFAULT_TARGET_RECALL, help="recall@10 target for the served parameters"),
    runner: str = RUNNER,
    workers: int = WORKERS,
    max_bytes: int = MAX_BYTES,
    max_delete_fraction: float = MAX_DELETE,
    allow_mass_delete: bool = ALLOW_MASS_DELETE,
    dtype: str = DTYPE,
    metadata: Optional[str] = METADATA,
    inventory: Optional[str] = INVENTORY,
    report_duplicates: bool = typer.Option(False, "--report-duplicates", help="After the builds, report the "
                                           "serving model's duplicate groups and how many are new"),
) -> None:
    """Ingest, then build and verify a fresh index and move `serving` to it."""
    try:
        from imgest import encoders
        from imgest.config import NightlyConfig
        from imgest.storage import open_location
        from imgest.tasks.listing import check_apart

        cfg = NightlyConfig(catalogue=catalogue, store=store, model=model, batch_size=batch_size, device=device,
                            kind=kind, memory=memory, target_recall=target_recall, runner=runner, workers=workers,
                            max_bytes=max_bytes, max_delete_fraction=max_delete_fraction,
                            allow_mass_delete=allow_mass_delete, dtype=dtype, metadata=metadata,
                            inventory=inventory, report_duplicates=report_duplicates, disk=disk)
        if cfg.model:
            encoders.resolve(cfg.model)
        check_apart(open_location(cfg.catalogue, must_exist=True, what="catalogue"), open_location(cfg.store))

        from imgest.flows.nightly import nightly as nightly_flow
        from imgest.tasks.commit import RunSummary
        from imgest.tasks.markdown import render_card, render_summary

        with reporting():
            result = nightly_flow(**asdict(cfg))
    except _user_errors() as exc:
        _fail(exc)
    for base in result["bases"]:  # a head's base model, ingested first
        typer.echo(render_summary(RunSummary(**base)))
    for run in result["models"]:  # two while a migration window is open
        typer.echo(render_summary(RunSummary(**run["ingest"])))
        index = run["index"]
        typer.echo(render_card(index["card"]) if index["built"] else f"no index built: {index['reason']}")


@app.command()
def demo(
    workdir: str = typer.Option("demo", help="Where to put the demo catalogue and store"),
    per_class: int = typer.Option(60, help="Fashion-MNIST images per class (10 classes)"),
) -> None:
    """Build a demo catalogue of real offline images, run the nightly job on it, search it once."""
    from imgest.demo import build_demo_catalogue

    catalogue = os.path.join(workdir, "catalogue")
    store_dir = os.path.join(workdir, "store")
    if not os.path.exists(catalogue):
        counts = build_demo_catalogue(catalogue, fashion_per_class=per_class)
        typer.echo(f"demo catalogue written to {catalogue}: {counts}")
    nightly(catalogue=catalogue, store=store_dir, model=None, batch_size=DEFAULT_BATCH_SIZE,
            device=DEFAULT_DEVICE, kind=DEFAULT_KIND, memory=DEFAULT_MEMORY, target_recall=DEFAULT_TARGET_RECALL,
            runner=DEFAULT_RUNNER, workers=DEFAULT_WORKERS, max_bytes=DEFAULT_MAX_BYTES,
            max_delete_fraction=DEFAULT_MAX_DELETE_FRACTION, allow_mass_delete=False, dtype=DEFAULT_DTYPE,
            metadata=None, inventory=None, report_duplicates=False, disk=DEFAULT_DISK)
    status(store=store_dir, as_json=False)
    query = os.path.join(catalogue, "photos", "chelsea.jpg")
    typer.echo(f"\n$ imgest search --store {store_dir} --image {query} --k 5")
    from imgest.cli.index_cmds import search_cmd
    from imgest.tasks.fusion import RRF_K

    search_cmd(store=store_dir, image=query, text=None, queries=None, k=5, alias=["serving"], model=None,
               version=None, device=DEFAULT_DEVICE, fuse=None, rrf_k=RRF_K, where=None, group_by=None, per_group=1,
               route=None, query_class=None, as_json=False)
