"""The `imgest` command line: ingest, status, export, demo."""

from __future__ import annotations

import os

# Prefect's ephemeral server must work offline and may take a while to start on a small machine.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import json  # noqa: E402
import sys  # noqa: E402
from typing import Optional  # noqa: E402

import typer  # noqa: E402

from imgest.storage import redact  # noqa: E402

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Batch ingestion of image catalogues into model-tagged Parquet embedding shards.")


def _fail(exc: BaseException) -> None:
    typer.echo(f"imgest: error: {redact(exc)}", err=True)
    raise typer.Exit(code=2)


def _user_errors() -> tuple[type[BaseException], ...]:
    from flows.config import ConfigError
    from imgest.encoders import EncoderError
    from imgest.lock import StoreLockedError
    from imgest.storage import StorageError
    from tasks.export import ModelNotFoundError

    return ConfigError, EncoderError, StoreLockedError, StorageError, ModelNotFoundError, FileNotFoundError


@app.command()
def ingest(
    catalogue: str = typer.Option(..., help="Folder or URL of the catalogue: /path, file://, s3://bucket/prefix"),
    store: str = typer.Option(..., help="Folder or URL where shards and state are kept"),
    model: str = typer.Option("efficientnet-lite0", help="efficientnet-lite0 or hf:<hub id or local folder>"),
    batch_size: str = typer.Option("auto", help="'auto' (measured, cached per model and device) or N"),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N"),
    shard_size: int = typer.Option(2000, help="Images per shard (one Prefect task per shard)"),
    decode_workers: int = typer.Option(2, help="Threads reading and decoding ahead of the encoder"),
    max_pixels: int = typer.Option(100_000_000, help="Larger images are rejected as decompression bombs"),
    as_json: bool = typer.Option(False, "--json", help="Print the run summary as JSON"),
) -> None:
    """Encode what is new or changed in the catalogue; tombstone what was deleted."""
    try:
        from flows.config import IngestConfig
        from imgest import encoders
        from imgest.storage import open_location

        # Fail on bad input before Prefect starts its server: a one-line reason, exit 2.
        cfg = IngestConfig(catalogue, store, model, batch_size, device, shard_size, decode_workers, max_pixels)
        encoders.resolve(cfg.model)
        encoders.resolve_device(cfg.device)
        open_location(cfg.catalogue, must_exist=True, what="catalogue")
        open_location(cfg.store)

        from flows.ingest import ingest as ingest_flow
        from tasks.commit import RunSummary
        from tasks.report import render_summary

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
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output (keys in the README)"),
) -> None:
    """Per model: live items, shards, rejected items with reasons, tombstones, last run."""
    from tasks.export import store_status

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
    from tasks.export import export_live

    try:
        result = export_live(store, model, out)
    except _user_errors() as exc:
        _fail(exc)
    typer.echo(f"exported {result['rows']} live embeddings of {result['model_id']} to {result['out']}")


@app.command()
def demo(
    workdir: str = typer.Option("demo", help="Where to put the demo catalogue and store"),
    per_class: int = typer.Option(60, help="Fashion-MNIST images per class (10 classes)"),
) -> None:
    """Build a demo catalogue of real offline images, ingest it, then show the store's status."""
    from imgest.demo import build_demo_catalogue

    catalogue = os.path.join(workdir, "catalogue")
    if not os.path.exists(catalogue):
        counts = build_demo_catalogue(catalogue, fashion_per_class=per_class)
        typer.echo(f"demo catalogue written to {catalogue}: {counts}")
    ingest(catalogue=catalogue, store=os.path.join(workdir, "store"), model="efficientnet-lite0",
           batch_size="auto", device="auto", shard_size=2000, decode_workers=2, max_pixels=100_000_000,
           as_json=False)
    status(store=os.path.join(workdir, "store"), as_json=False)


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
