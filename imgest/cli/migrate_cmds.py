"""Commands: migrate start, status, promote, rollback, finish."""

from __future__ import annotations

import json
from typing import Optional

import typer

from imgest.cli import _fail, _user_errors, app
from imgest.defaults import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_DEVICE,
    DEFAULT_DISK,
    DEFAULT_KIND,
    DEFAULT_MEMORY,
    DEFAULT_RETAIN_DAYS,
)

migrate_app = typer.Typer(help="Change the embedding model through a dual-index migration window.",
                          no_args_is_help=True)
app.add_typer(migrate_app, name="migrate")


def _migrate(store: str, action: str, as_json: bool = False, **params) -> None:
    try:
        from imgest.config import MigrateConfig
        from imgest.storage import open_location

        MigrateConfig(store=store, action=action, **params)  # before Prefect starts: one line, exit 2
        open_location(store, must_exist=True, what="store")
        if action == "status":  # read-only: no Prefect run needed
            from imgest.tasks.migration import window_status

            result = window_status(open_location(store))
        else:
            from imgest.flows.migrate import migrate

            result = migrate(store=store, action=action, **params)
    except _user_errors() as exc:
        _fail(exc)
    if as_json:
        typer.echo(json.dumps(result, indent=2, default=str))
    elif "finished" in result:
        typer.echo(f"window {result['finished']['window']['id']} finished; deleted now: "
                   f"{result['finished']['deleted'] or 'nothing yet (retention, or an alias still points at it)'}")
    else:
        from imgest.tasks.markdown import render_window

        typer.echo(render_window(result))


@migrate_app.command("start")
def migrate_start(
    store: str = typer.Option(..., help="Folder or URL of the store"),
    to: str = typer.Option(..., help="The new model"),
    catalogue: Optional[str] = typer.Option(None, help="Default: the serving model's last catalogue"),
    batch_size: str = typer.Option(DEFAULT_BATCH_SIZE, help="'auto' or N"),
    device: str = typer.Option(DEFAULT_DEVICE, help="auto, cpu, cuda or cuda:N"),
    kind: str = typer.Option(DEFAULT_KIND, help="Index kind for the new model"),
    memory: str = typer.Option(DEFAULT_MEMORY, help="Memory budget for the new index"),
    disk: str = typer.Option(DEFAULT_DISK, help="Local disk for a PQ index's float16 re-rank vectors"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Open (or resume) a window: re-encode with the new model, build its index, point `shadow` at it."""
    _migrate(store, "start", as_json, to=to, catalogue=catalogue, batch_size=batch_size, device=device, kind=kind,
             memory=memory, disk=disk)


@migrate_app.command("status")
def migrate_status(store: str = typer.Option(..., help="Folder or URL of the store"),
                   as_json: bool = typer.Option(False, "--json")) -> None:
    """Coverage, index currency, aliases, evaluation and storage of the open window."""
    _migrate(store, "status", as_json)


@migrate_app.command("promote")
def migrate_promote(
    store: str = typer.Option(..., help="Folder or URL of the store"),
    gate: Optional[str] = typer.Option(None, help="An `imgest eval --alias serving --compare shadow --json` report "
                                                  "made elsewhere; recorded in the window as its evaluation"),
    margin: float = typer.Option(0.0, help="Allowed drop of shadow's metric below serving's"),
    force: Optional[str] = typer.Option(None, help="Promote without (or against) the evaluation; the reason is "
                                                   "recorded in the window and the alias history"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Swap `serving` to the new model: full coverage, a current checksummed index, and an evaluation of shadow
    against serving recorded in the window where shadow is not worse beyond --margin (or --force "reason")."""
    gate_obj = None
    if gate:
        from imgest.storage import read_url

        try:
            gate_obj = json.loads(read_url(gate))
        except _user_errors() as exc:
            _fail(exc)
    _migrate(store, "promote", as_json, gate=gate_obj, margin=margin, force=force)


@migrate_app.command("rollback")
def migrate_rollback(store: str = typer.Option(..., help="Folder or URL of the store"),
                     as_json: bool = typer.Option(False, "--json")) -> None:
    """Swap `serving` back to the old model, any time before finish."""
    _migrate(store, "rollback", as_json)


@migrate_app.command("finish")
def migrate_finish(store: str = typer.Option(..., help="Folder or URL of the store"),
                   retain_days: float = typer.Option(DEFAULT_RETAIN_DAYS, help="Keep the retired model's data this "
                                                                               "long"),
                   as_json: bool = typer.Option(False, "--json")) -> None:
    """Close the window; the model no longer serving is deleted after the retention, never while aliased."""
    _migrate(store, "finish", as_json, retain_days=retain_days)
