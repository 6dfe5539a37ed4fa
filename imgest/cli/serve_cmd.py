"""Command: serve (a local Prefect stack: server, work pool, deployments, worker; it serves Prefect, not search)."""

from __future__ import annotations

import typer

from imgest.cli import _fail, app


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Address the Prefect server listens on"),
    port: int = typer.Option(4200, help="Port of the Prefect server and its UI"),
) -> None:
    """Start a Prefect server, the process pool, the package's deployments and a worker; Ctrl-C stops them."""
    from imgest.prefect_stack import ServeError
    from imgest.prefect_stack import serve as serve_all

    try:
        serve_all(host=host, port=port, say=lambda line: print(line, flush=True))
    except ServeError as exc:
        _fail(exc)
