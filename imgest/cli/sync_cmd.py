"""Command: sync (a vector database kept in step with a model's live items)."""

from __future__ import annotations

import json

import typer

from imgest.cli.app import app, fail
from imgest.cli.options import config_command
from imgest.config import SyncConfig
from imgest.errors import USER_ERRORS
from imgest.storage import redact


@app.command("sync")
@config_command(SyncConfig)
def sync_cmd(
    config: SyncConfig,
    as_json: bool = typer.Option(False, "--json", help="Print what was sent and the watermark as JSON"),
) -> None:
    """Upsert a model's new and changed items into Milvus, Qdrant or LanceDB and delete its deleted ones:
    only what changed since the target's last sync, resumable after a crash. A target that fails is one line
    naming it, the batch and what it said; exit 1, nothing recorded, and the next sync catches up."""
    from imgest.tasks.sync.targets import TargetError

    try:
        from imgest.progress import reporting
        from imgest.tasks.sync.run import sync
        from imgest.tasks.sync.targets import SyncError
        from imgest.tasks.sync.watermark import WatermarkError

        with reporting():
            result = sync(config)
    except (*USER_ERRORS, SyncError, WatermarkError) as exc:
        fail(exc)
    except TargetError as exc:  # the target's failure, not the command's use: exit 1, as a nightly's sync
        typer.echo(f"imgest: {redact(exc)}", err=True)
        raise typer.Exit(code=1) from None
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    mark = result["watermark"]
    typer.echo(f"synced {result['target']} with model {result['model']}: {result['upserted']} item(s) upserted, "
               f"{result['deleted']} deleted; it now holds the {result['live']} live item(s) of the store's state "
               f"{mark['state_seq']} (watermark {mark['key']}).")
