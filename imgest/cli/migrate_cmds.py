"""Commands: migrate start, status, promote, rollback, finish."""

from __future__ import annotations

import json
from typing import Optional

import typer

from imgest.cli.app import app, check_model, fail
from imgest.cli.options import config_command
from imgest.config import MigrateConfig
from imgest.errors import USER_ERRORS

migrate_app = typer.Typer(help="Change the embedding model through a dual-index migration window.",
                          no_args_is_help=True)
app.add_typer(migrate_app, name="migrate")


def _migrate(config: MigrateConfig, as_json: bool = False) -> None:
    try:
        from imgest.storage import open_location

        open_location(config.store, must_exist=True, what="store")
        if config.action == "start":
            check_model(config.to, config.store)
        if config.action == "status":  # read-only: no Prefect run needed
            from imgest.tasks.migration.window import window_status

            result = window_status(open_location(config.store))
        else:
            from imgest.flows.migrate import migrate

            result = migrate(config)
    except USER_ERRORS as exc:
        fail(exc)
    if as_json:
        typer.echo(json.dumps(result, indent=2, default=str))
    elif "finished" in result:
        already = " had already finished (closed at " + str(result["finished"]["window"].get("closed_at")) + ")" \
            if result["finished"].get("already_finished") else " finished"
        typer.echo(f"window {result['finished']['window']['id']}{already}; deleted now: "
                   f"{result['finished']['deleted'] or 'nothing yet (retention, or an alias still points at it)'}")
    else:
        from imgest.reports.migration import render_window

        typer.echo(render_window(result))
    if any("error" in sync for sync in result.get("targets", {}).get("switched", [])):
        raise typer.Exit(code=1)  # the move stands; a target that did not follow is the operator's to look at


JSON = typer.Option(False, "--json")
START = ("store", "to", "catalogue", "inventory", "batch_size", "device", "runtime", "precision", "kind", "memory",
         "target_recall", "shard_size", "disk", "decoder", "force_decoder", "keep_pixels")


@migrate_app.command("start")
@config_command(MigrateConfig, only=START, fixed={"action": "start"})
def migrate_start(config: MigrateConfig, as_json: bool = JSON) -> None:
    """Open (or resume) a window: re-encode with the new model, build its index, point `shadow` at it."""
    _migrate(config, as_json)


@migrate_app.command("status")
@config_command(MigrateConfig, only=("store",), fixed={"action": "status"})
def migrate_status(config: MigrateConfig, as_json: bool = JSON) -> None:
    """Coverage, index currency, aliases, evaluation and storage of the open window."""
    _migrate(config, as_json)


@migrate_app.command("promote")
@config_command(MigrateConfig, only=("store", "margin", "force", "min_shadow_agreement", "sync_to"),
                fixed={"action": "promote"})
def migrate_promote(
    config: MigrateConfig,
    gate: Optional[str] = typer.Option(None, "--gate", help=MigrateConfig.model_fields["gate"].description),
    as_json: bool = JSON,
) -> None:
    """Swap `serving` to the new model: full coverage, a current checksummed index, and an evaluation of shadow
    against serving recorded in the window where shadow is not worse beyond --margin (or --force "reason")."""
    if gate:  # a file here; the report itself in the flow's parameters
        from imgest.storage import read_url

        try:
            config = config.model_copy(update={"gate": json.loads(read_url(gate))})
        except USER_ERRORS as exc:
            fail(exc)
    _migrate(config, as_json)


@migrate_app.command("rollback")
@config_command(MigrateConfig, only=("store", "sync_to"), fixed={"action": "rollback"})
def migrate_rollback(config: MigrateConfig, as_json: bool = JSON) -> None:
    """Swap `serving` back to the old model, any time before finish."""
    _migrate(config, as_json)


@migrate_app.command("finish")
@config_command(MigrateConfig, only=("store", "retain_days"), fixed={"action": "finish"})
def migrate_finish(config: MigrateConfig, as_json: bool = JSON) -> None:
    """Close the window; the model no longer serving is deleted after the retention, never while aliased."""
    _migrate(config, as_json)
