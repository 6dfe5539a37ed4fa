"""Commands: alerts apply (the automations that notify an operator, on an existing Prefect server)."""

from __future__ import annotations

import json
from typing import Optional

import typer

from imgest.cli.app import app, fail

alerts_app = typer.Typer(help="Alerts: Prefect automations that notify when a night fails, is late or drifts.",
                         no_args_is_help=True)
app.add_typer(alerts_app, name="alerts")


@alerts_app.command("apply")
def alerts_apply(
    notify: Optional[str] = typer.Option(None, "--notify", help="Webhook to post to: Slack or Teams incoming "
                                         "webhook, or any URL taking JSON {subject, body}; none: the automations "
                                         "exist and tell nobody"),
    no_nightly_within: float = typer.Option(26.0, "--no-nightly-within", help="Alert when no nightly completed "
                                                                              "within this many hours"),
    as_json: bool = typer.Option(False, "--json", help="Print what was applied as JSON"),
) -> None:
    """Create or update the alerts on the Prefect server PREFECT_API_URL names (one of each, however often run)."""
    import httpx
    from prefect.exceptions import PrefectHTTPStatusError

    from imgest.tasks.watch.alerts import AlertError, apply_alerts

    try:
        applied = apply_alerts(notify, no_nightly_within)
    except AlertError as exc:
        fail(exc)
    except (httpx.HTTPError, PrefectHTTPStatusError) as exc:  # no server there, or it refused: nothing applied
        from prefect.settings import PREFECT_API_URL

        fail(RuntimeError(f"the Prefect API at {PREFECT_API_URL.value()} could not apply the alerts: "
                           f"{type(exc).__name__}: {exc}"))
    if as_json:
        typer.echo(json.dumps(applied, indent=2))
        return
    for entry in applied:
        typer.echo(f"{entry['name']}: {'notifies' if entry['notifies'] else 'tells nobody (no --notify)'}")
