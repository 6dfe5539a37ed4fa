"""Commands: ingest, status, export, reencode, nightly, demo."""

from __future__ import annotations

import json
import os
from typing import Optional

import typer

from imgest.cli.app import app, check_decoder, check_model, fail
from imgest.cli.options import config_command
from imgest.config import IngestConfig, NightlyConfig, ReencodeConfig
from imgest.config.fields import OWN_MODEL
from imgest.errors import USER_ERRORS
from imgest.names import DEFAULT_DEVICE
from imgest.progress import reporting
from imgest.retrieval.fusion import RRF_K


@app.command()
@config_command(IngestConfig)
def ingest(
    config: IngestConfig,
    as_json: bool = typer.Option(False, "--json", help="Print the run summary as JSON"),
) -> None:
    """Encode what is new or changed in the catalogue; tombstone what was deleted."""
    try:
        from imgest.images.listing import check_apart
        from imgest.state.models import default_model
        from imgest.storage import open_location

        # Fail on bad input before Prefect starts its server: a one-line reason, exit 2.
        store = open_location(config.store)
        config = config.model_copy(update={"model": default_model(store, config.model, field="name")})
        check_model(config.model, config.store)
        check_decoder(config)
        check_apart(open_location(config.catalogue, must_exist=True, what="catalogue"), store)

        from imgest.flows.ingest import ingest as ingest_flow
        from imgest.reports.ingest import render_summary
        from imgest.tasks.ingest.commit import RunSummary

        with reporting():
            summary = ingest_flow(config)
    except USER_ERRORS as exc:
        fail(exc)
    if as_json:
        typer.echo(json.dumps(summary, indent=2, default=str))
    else:
        typer.echo(render_summary(RunSummary(**summary)))


@app.command()
def status(
    store: str = typer.Option(..., help="Folder or URL of the store"),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output (keys in docs/evaluation.md)"),
    history: bool = typer.Option(False, "--history", help="The last nightly runs per model, as the nightly-trend "
                                                          "artifact shows them: unusual figures marked with !"),
    nights: int = typer.Option(30, "--nights", min=1, help="With --history: how many nights per model"),
) -> None:
    """Per model: live items, shards, rejected items with reasons, tombstones, its JPEG decoder, last run; the
    serving index and the runtimes, precisions and JPEG decoders that made its vectors."""
    from imgest.retrieval.status import store_status

    if history:
        _history(store, nights, as_json)
        return
    try:
        report = store_status(store)
    except USER_ERRORS as exc:
        fail(exc)
    if as_json:
        typer.echo(json.dumps(report, indent=2, default=str))
        return
    typer.echo(f"store: {report['store']}")
    if report["running"]:
        typer.echo(f"running: {report['running']['owner']} since {report['running']['started']}")
    if serving := report["serving"]:
        from imgest.reports.index import render_encoded_by

        vectors = f"{serving['n']:,} vectors, " if serving.get("n") is not None else ""
        typer.echo(f"serving: {serving['error']}" if "error" in serving else
                   f"serving: model={serving['slug']} v{serving['version']:04d}, {vectors}encoded by: "
                   f"{render_encoded_by(serving['encoded_by'])}")
        if "error" not in serving:
            typer.echo(f"  JPEGs decoded by: {render_encoded_by(serving.get('decoded_by'))}")
    if not report["models"]:
        typer.echo("no models ingested yet")
    for m in report["models"]:
        last = m["last_run"] or {}
        typer.echo(f"\nmodel {m['name']} ({m['slug']}), dim {m['dim']}\n  model id: {m['model_id']}")
        typer.echo(f"  live {m['live']} in {m['shards']} shard(s), rejected {len(m['rejected'])}, "
                   f"tombstones {m['tombstones']}, snapshot {m['snapshot']}, pending shards {m['pending_shards']}")
        if m.get("decoder"):
            typer.echo(f"  JPEG decode: {m['decoder']['describe']}")
        if (kept := m.get("kept_pixels")) and (kept["files"] or kept["side"]):
            setting = f"kept at side {kept['side']}" if kept["side"] else "not kept by later runs"
            typer.echo(f"  kept pixels: {setting}; {kept['live_items']:,} of {m['live']:,} live items covered, "
                       f"{kept['bytes'] / 2**20:,.1f} MiB in {kept['files']} file(s)"
                       + (f" (sides {', '.join(map(str, kept['sides']))})" if len(kept["sides"]) > 1 else ""))
        if last:
            typer.echo(f"  last run {last.get('run_id')} finished {last.get('finished')}: encoded "
                       f"{last.get('encoded')}, {last.get('images_per_second')} img/s")
            if last.get("device_note"):
                typer.echo(f"  device: {last['device_note']}")
        for rej in m["rejected"]:
            typer.echo(f"  rejected {rej['item_id']}: {rej['reason']}")


def _history(store: str, nights: int, as_json: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    from imgest.storage import open_location
    from imgest.tasks.watch.history import read_history
    from imgest.tasks.watch.trend import COLUMNS, trend_rows

    try:
        rows = read_history(open_location(store, must_exist=True, what="store"), nights=nights)
    except USER_ERRORS as exc:
        fail(exc)
    if as_json:
        typer.echo(json.dumps(rows, indent=2, default=str))
        return
    if not rows:
        typer.echo("no nightly history yet: each nightly run writes one row per model")
        return
    console = Console(width=200)
    for slug in dict.fromkeys(r["slug"] for r in rows):
        table = Table(title=f"model {slug}", title_justify="left")
        for name, _, _ in COLUMNS:
            table.add_column(name, justify="left" if name in ("date", "index") else "right")
        mine = [r for r in rows if r["slug"] == slug]
        for printed in trend_rows(mine):
            table.add_row(*(str(printed[name]) for name, _, _ in COLUMNS))
        console.print(table)
        for row in mine:
            for mark in row.get("marks", []):
                console.print(f"  ! {row['date']}: {mark['meaning']}: {mark['value']:g} against a median of "
                              f"{mark['median']:g} over {mark['nights']} night(s)", highlight=False)


@app.command()
def export(
    store: str = typer.Option(..., help="Folder or URL of the store"),
    model: Optional[str] = typer.Option(None, help="Model name, model id or slug as shown by `imgest status`; "
                                                   f"{OWN_MODEL}"),
    out: str = typer.Option(..., help="Output Parquet file (local path or URL)"),
) -> None:
    """Write the live embeddings of one model, one row per live item, as a Parquet file."""
    from imgest.state.export import export_live

    try:
        result = export_live(store, model, out)
    except USER_ERRORS as exc:
        fail(exc)
    typer.echo(f"exported {result['rows']} live embeddings of {result['model_id']} to {result['out']}")


@app.command()
@config_command(ReencodeConfig)
def reencode(config: ReencodeConfig) -> None:
    """Encode the whole catalogue with a new model into its own namespace (resumable; old data untouched)."""
    try:
        from imgest.storage import open_location

        check_model(config.model, config.store)
        check_decoder(config)
        open_location(config.catalogue, must_exist=True, what="catalogue")
        from imgest.flows.reencode import reencode as reencode_flow
        from imgest.reports.ingest import render_reencode

        with reporting():
            summary = reencode_flow(config)
    except USER_ERRORS as exc:
        fail(exc)
    typer.echo(render_reencode(summary))


@app.command()
@config_command(NightlyConfig)
def nightly(config: NightlyConfig) -> None:
    """Ingest, then build and verify a fresh index and move `serving` to it."""
    try:
        from imgest.images.listing import check_apart
        from imgest.storage import open_location

        if config.model:
            check_model(config.model, config.store)
        from imgest.tasks.sync.targets import parse_target

        for target in config.sync_to:  # before Prefect starts: a bad target refuses the night, not its end
            parse_target(target)
        check_apart(open_location(config.catalogue, must_exist=True, what="catalogue"), open_location(config.store))

        from imgest.flows.nightly import nightly as nightly_flow
        from imgest.reports.index import render_card
        from imgest.reports.ingest import render_summary
        from imgest.tasks.ingest.commit import RunSummary

        with reporting():
            result = nightly_flow(config)
    except USER_ERRORS as exc:
        fail(exc)
    for base in result["bases"]:  # a head's base model, ingested first
        typer.echo(render_summary(RunSummary(**base)))
    for run in result["models"]:  # two while a migration window is open
        typer.echo(render_summary(RunSummary(**run["ingest"])))
        index = run["index"]
        typer.echo(render_card(index["card"]) if index["built"] else f"no index built: {index['reason']}")
    for synced in result.get("synced", []):
        if "error" in synced:
            typer.echo(f"sync to {synced['target']} failed: {synced['error']} (the next sync catches up)")
        else:
            typer.echo(f"synced {synced['target']} with {synced['model']} into {synced['collection']}"
                       f"{' (the name answers for it)' if synced['answers'] else ''}: {synced['upserted']} upserted, "
                       f"{synced['deleted']} deleted, {synced['live']} live (watermark {synced['watermark']['key']})")
    if any("error" in synced for synced in result.get("synced", [])):
        raise typer.Exit(code=1)


@app.command()
def demo(
    workdir: str = typer.Option("demo", help="Where to put the demo catalogue and store"),
    per_class: int = typer.Option(60, help="Fashion-MNIST images per class (10 classes)"),
) -> None:
    """Build a demo catalogue of real offline images with its catalogue text, run the nightly job on it (images
    and the caption retriever), search it once, and print the commands to try next."""
    from imgest.cli.index_cmds import build_index_cmd, search_cmd
    from imgest.encoders.text import NAME as CAPTION_MODEL
    from imgest.images.demo import build_demo_catalogue, write_demo_metadata
    from imgest.retrieval.combined import CAPTIONS
    from imgest.state.aliases import read_alias
    from imgest.storage import open_location

    catalogue = os.path.join(workdir, "catalogue")
    store_dir = os.path.join(workdir, "store")
    metadata = os.path.join(workdir, "metadata.csv")  # beside the catalogue, as a shop's product feed is
    if not os.path.exists(catalogue):
        counts = build_demo_catalogue(catalogue, fashion_per_class=per_class)
        typer.echo(f"demo catalogue written to {catalogue}: {counts}")
    if not os.path.exists(metadata):
        typer.echo(f"catalogue text (title, category) for {write_demo_metadata(catalogue, metadata)} images "
                   f"written to {metadata}")
    # every other option at its default, from the model; the nightly keeps every aliased model current, so
    # after the first run it re-encodes the caption retriever's changed titles too
    nightly(catalogue=catalogue, store=store_dir, metadata=metadata)
    if read_alias(open_location(store_dir), CAPTIONS) is None:  # the first run: the caption retriever beside it
        ingest(catalogue=catalogue, store=store_dir, model=CAPTION_MODEL, metadata=metadata, as_json=False)
        build_index_cmd(store=store_dir, model=CAPTION_MODEL, alias=CAPTIONS, as_json=False)
    status(store=store_dir, as_json=False)
    query = os.path.join(catalogue, "photos", "chelsea.jpg")
    typer.echo(f"\n$ imgest search --store {store_dir} --image {query} --k 5")
    search_cmd(store=store_dir, image=query, text=None, item_id=None, queries=None, k=5, alias=["serving"], model=None,
               version=None, device=DEFAULT_DEVICE, fuse=None, rrf_k=RRF_K, where=None, group_by=None, per_group=1,
               route=None, query_class=None, as_json=False)
    boots = os.path.join(catalogue, "fashion", "ankle-boot")
    item = f"fashion/ankle-boot/{min(os.listdir(boots))}"
    typer.echo("\n" + next_steps(store_dir, query, item))


def next_steps(store: str, query: str, item: str) -> str:
    """What to try after the demo, each command as it runs from here (the program as it was called)."""
    import shlex
    import sys

    prog = sys.argv[0] if os.path.basename(sys.argv[0]) == "imgest" else "imgest"
    prog, store, query, item = (shlex.quote(x) for x in (prog, store, query, item))
    return "\n".join([
        "Next, try:",
        f"  {prog} api --store {store}    # the search page on http://127.0.0.1:8000/ (text, image drop, filters)",
        f"  {prog} search --store {store} --text 'ankle boot' --k 10    # by the catalogue's titles",
        f"  {prog} search --store {store} --text shoes --where \"category = 'sneaker'\"    # filtered",
        f"  {prog} search --store {store} --item-id {item} --alias captions --alias serving --fuse rrf    "
        "# more like this item, by its title and its picture",
        f"  {prog} migrate start --store {store} --to raw-pixels    # a migration window beside serving; then "
        "migrate status, promote or rollback",
    ])
