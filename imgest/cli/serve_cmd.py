"""Command: serve (a local Prefect stack: server, work pool, deployments, worker; it serves Prefect, not search)."""

from __future__ import annotations

from typing import Optional

import typer

from imgest.cli.app import app, fail


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Address the Prefect server listens on"),
    port: int = typer.Option(4200, help="Port of the Prefect server and its UI"),
    notify: Optional[str] = typer.Option(None, "--notify", help="Webhook the alerts post to: Slack or Teams "
                                         "incoming webhook, or any URL taking JSON {subject, body}"),
    no_nightly_within: float = typer.Option(26.0, "--no-nightly-within", help="Alert when no nightly completed "
                                                                              "within this many hours"),
) -> None:
    """Start a Prefect server, the process pool, the package's deployments and a worker; Ctrl-C stops them."""
    from imgest.cli.prefect_stack import ServeError
    from imgest.cli.prefect_stack import serve as serve_all
    from imgest.tasks.watch.alerts import AlertError

    try:
        serve_all(host=host, port=port, say=lambda line: print(line, flush=True), notify=notify,
                  nightly_within_hours=no_nightly_within)
    except (ServeError, AlertError) as exc:
        fail(exc)
