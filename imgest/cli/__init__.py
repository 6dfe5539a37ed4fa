"""The `imgest` command line; commands live in the modules of this package, by concern."""

from __future__ import annotations

import os

# Prefect's ephemeral server must work offline and may take a while to start on a small machine.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import typer  # noqa: E402
from typer.core import TyperGroup  # noqa: E402

from imgest.storage import one_line, redact  # noqa: E402

DEBUG_VARIABLE = "IMGEST_DEBUG"
# typer's own ends pass through the last resort: Exit (exit codes), Abort (Ctrl-C) and usage errors, whose base is
# click's ClickException (typer 0.12 uses click's, newer versions carry their own copy of click)
_TYPER_ENDS = (typer.Exit, typer.Abort, next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException"))


class _Commands(TyperGroup):
    """The commands, with the last resort of every one: an error nothing foresaw (a library's own, an engine's
    client's) is one line naming the command, exit 1; its traceback (masked) only with --debug or IMGEST_DEBUG=1."""

    def invoke(self, ctx: typer.Context):
        try:
            return super().invoke(ctx)
        except _TYPER_ENDS:
            raise
        except Exception as exc:
            debug = ctx.params.get("debug") or os.environ.get(DEBUG_VARIABLE, "").lower() in ("1", "true", "yes")
            if debug:
                import traceback

                typer.echo(redact(traceback.format_exc()).rstrip(), err=True)
            hint = "" if debug else f" (--debug or {DEBUG_VARIABLE}=1 shows the traceback)"
            said = one_line(exc, limit=1000)
            typer.echo(f"imgest: {ctx.invoked_subcommand or 'command'} failed: {said}{hint}", err=True)
            raise typer.Exit(code=1) from None


app = typer.Typer(add_completion=False, no_args_is_help=True, cls=_Commands,
                  help="Batch ingestion of image catalogues into model-tagged Parquet embedding shards.")


@app.callback()
def _options(debug: bool = typer.Option(False, "--debug", help=f"Show the traceback of an unexpected error "
                                        f"(masked), as {DEBUG_VARIABLE}=1 does")) -> None:
    pass  # read back by the last-resort handler above


def _fail(exc: BaseException) -> None:
    typer.echo(f"imgest: error: {redact(exc)}", err=True)
    raise typer.Exit(code=2)


def _user_errors() -> tuple[type[BaseException], ...]:
    from imgest.config import ConfigError
    from imgest.encoders import EncoderError
    from imgest.lock import LockLostError, StoreLockedError
    from imgest.names import SizeError
    from imgest.records import RecordError
    from imgest.storage import StorageError
    from imgest.tasks.evaluate.querysets import QuerySetError
    from imgest.tasks.evaluate.routing import RoutingError
    from imgest.tasks.heads.train import HeadError
    from imgest.tasks.index.choice import IndexChoiceError
    from imgest.tasks.index.store import IndexIntegrityError, IndexNotFoundError
    from imgest.tasks.ingest.inventory import InventoryError
    from imgest.tasks.ingest.metadata import MetadataError
    from imgest.tasks.ingest.plan import MassDeleteError
    from imgest.tasks.migration.aliases import AliasError
    from imgest.tasks.migration.window import MigrationError
    from imgest.tasks.search.query import SearchError
    from imgest.tasks.state.catalogue_images import CatalogueRootError
    from imgest.tasks.state.models import ModelNotFoundError
    from imgest.tasks.sync.targets import SyncError

    return (ConfigError, EncoderError, StoreLockedError, StorageError, ModelNotFoundError, FileNotFoundError,
            IndexChoiceError, IndexIntegrityError, IndexNotFoundError, SearchError, MigrationError, QuerySetError,
            HeadError, MassDeleteError, MetadataError, InventoryError, AliasError,
            CatalogueRootError, RecordError, RoutingError, LockLostError, SizeError, SyncError)


def _check_model(name: str, store: str) -> None:
    """Before Prefect starts: the model resolves, and the store's later readers will take its name back."""
    from imgest import encoders
    from imgest.storage import open_location

    encoders.refuse_unrecordable(encoders.resolve(name), open_location(store))


# Registers the commands on `app` (each module imports it from here).
from imgest.cli import (  # noqa: E402, F401
    alerts_cmd,
    api_cmd,
    eval_cmds,
    head_cmds,
    index_cmds,
    ingest_cmds,
    migrate_cmds,
    serve_cmd,
    sync_cmd,
)
