"""The `imgest` application: its commands' last resort for the unforeseen, and the one line an error the user can
act on becomes."""

from __future__ import annotations

import os

import typer
from typer.core import TyperGroup

from imgest.storage import one_line, redact

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


def fail(exc: BaseException) -> None:
    """An error the user can act on (imgest.errors.USER_ERRORS), as one line and exit 2."""
    typer.echo(f"imgest: error: {redact(exc)}", err=True)
    raise typer.Exit(code=2)


def check_model(name: str, store: str) -> None:
    """Before Prefect starts: the model resolves, the store's later readers will take its name back, and what
    loading it imports is installed here."""
    from imgest import encoders
    from imgest.storage import open_location

    spec = encoders.resolve(name)
    encoders.refuse_unrecordable(spec, open_location(store))
    encoders.refuse_missing_packages(spec)


def check_decoder(config) -> None:
    """Before Prefect starts: the JPEG decoder the model's vectors in this store were made with runs here, or the
    command says how to go on (an ingest or re-encode config: store, model, device, decoder, force_decoder)."""
    from imgest import encoders
    from imgest.images import decoders
    from imgest.storage import open_location

    spec = encoders.resolve(config.model)
    if "image" in spec.modalities:
        decoders.check(open_location(config.store), spec.slug, config.decoder, config.force_decoder,
                       encoders.resolve_device(config.device))
