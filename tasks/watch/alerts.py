"""Alerts as code: Prefect automations that tell someone when a run fails, when no nightly completed in time,
and when the pipeline reports one of its `imgest.*` events. Made by name, so applying them again updates
them in place: one of each, however often `imgest serve` or `imgest alerts apply` runs."""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import urlsplit
from uuid import UUID

from prefect.automations import Automation
from prefect.blocks.notifications import CustomWebhookNotificationBlock, MicrosoftTeamsWebhook, SlackWebhook
from prefect.events.actions import DoNothing, SendNotification
from prefect.events.schemas.automations import EventTrigger, Posture

from imgest.redact import redact_url

WATCHED_FLOWS = ("nightly", "reencode", "migrate")
DEFAULT_NIGHTLY_WITHIN_HOURS = 26.0
BLOCK_NAME = "imgest-alerts"
FAILED = "imgest: a run failed"
LATE = "imgest: no nightly completed"
REPORTED = "imgest: the pipeline reported an event"
_RUN_LINK = ("{% if flow_run %}\nrun {{ flow_run.id }}: {{ flow_run|ui_url or 'no link (set PREFECT_UI_URL)' }}"
             "{% endif %}")


class AlertError(ValueError):
    """The notification URL or the window cannot make an alert; says what would."""


def notification_block(url: str):
    """The block a `--notify` URL makes: Slack and Teams incoming webhooks by their hosts, anything else a
    generic JSON webhook receiving {"subject": ..., "body": ...}."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise AlertError(f"--notify must be an http(s) webhook URL; got {redact_url(url)}")
    host = parts.hostname or ""
    if host == "hooks.slack.com":
        return SlackWebhook(url=url)
    if host.endswith((".webhook.office.com", ".logic.azure.com")):
        return MicrosoftTeamsWebhook(url=url)
    return CustomWebhookNotificationBlock(name=BLOCK_NAME, url=url, method="POST",
                                          json_data={"subject": "{{subject}}", "body": "{{body}}"})


def definitions(block_id: UUID | None, nightly_within_hours: float) -> list[Automation]:
    """The three automations; with no block, they exist and do nothing (listed, so an operator sees them)."""
    if not nightly_within_hours > 0:
        raise AlertError(f"--no-nightly-within must be a number of hours > 0; got {nightly_within_hours}")

    def act(subject: str, body: str):
        return [SendNotification(block_document_id=block_id, subject=subject, body=body)] if block_id else \
            [DoNothing()]

    flows = {"prefect.resource.role": "flow", "prefect.resource.name": list(WATCHED_FLOWS)}
    return [
        Automation(
            name=FAILED, description="A nightly, re-encode or migrate run ended Failed, Crashed or TimedOut.",
            trigger=EventTrigger(expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed",
                                         "prefect.flow-run.TimedOut"},
                                 match_related=flows, posture=Posture.Reactive, threshold=1),
            actions=act("imgest: {{ flow.name }} run {{ flow_run.name }} {{ flow_run.state.name }}",
                        "{{ flow.name }} run {{ flow_run.name }} ended {{ flow_run.state.name }}: "
                        "{{ flow_run.state.message }}\n"
                        "store: {{ flow_run.parameters.config.store }}\n"
                        "model: {{ flow_run.parameters.config.model or 'the models the aliases point at' }}"
                        + _RUN_LINK)),
        Automation(
            name=LATE, description=f"No nightly run completed within {nightly_within_hours:g} hours.",
            trigger=EventTrigger(expect={"prefect.flow-run.Completed"},
                                 match_related={"prefect.resource.role": "flow", "prefect.resource.name": "nightly"},
                                 posture=Posture.Proactive, threshold=1,
                                 within=timedelta(hours=nightly_within_hours)),
            actions=act("imgest: no nightly completed", f"No nightly run completed in the last "
                                                        f"{nightly_within_hours:g} hours.")),
        Automation(
            name=REPORTED, description="The pipeline emitted an imgest.* event (docs/watching.md says each).",
            trigger=EventTrigger(expect={"imgest.*"}, posture=Posture.Reactive, threshold=1),
            actions=act("imgest: {{ event.event }} ({{ event.payload.model }})",
                        "{{ event.event }}: {{ event.payload.summary }}\n"
                        "store: {{ event.payload.store }}\nmodel: {{ event.payload.model }}\n"
                        "{% if event.payload.meaning %}{{ event.payload.meaning }}: {{ event.payload.value }} "
                        "against a median of {{ event.payload.median }}\n{% endif %}"
                        "{% if event.payload.why %}why: {{ event.payload.why }}\n{% endif %}" + _RUN_LINK)),
    ]


def apply_alerts(notify: str | None = None, nightly_within_hours: float = DEFAULT_NIGHTLY_WITHIN_HOURS) -> list[dict]:
    """Create or update the block and the automations on the current Prefect API; what each now does."""
    definitions(None, nightly_within_hours)  # a bad window fails before anything is written
    block = notification_block(notify) if notify else None
    block_id = block.save(BLOCK_NAME, overwrite=True) if block else None
    applied = []
    for wanted in definitions(block_id, nightly_within_hours):
        try:
            existing = Automation.read(name=wanted.name)
        except ValueError:  # none of that name yet
            existing = None
        if existing is None:
            made = wanted.create()
        else:
            made = existing.model_copy(update={"description": wanted.description, "trigger": wanted.trigger,
                                               "actions": wanted.actions, "enabled": True})
            made.update()
        applied.append({"name": made.name, "id": str(made.id), "notifies": block_id is not None})
    return applied
