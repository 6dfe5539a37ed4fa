"""Flow run names operators can read in the UI: `nightly-2026-11-29`, `ingest-2026-11-29-efficientnet-lite0`."""

from __future__ import annotations

from collections.abc import Callable


def _short_model(name: str) -> str:
    return name.removeprefix("hf:").rstrip("/").rsplit("/", 1)[-1] if name else ""


def run_name(kind: str, model_param: str | None = "model") -> Callable[[], str]:
    def make() -> str:
        from prefect.runtime import flow_run

        params = flow_run.parameters or {}
        config = params.get("config", params)  # a flow's configuration (flat: a deployment of an earlier version)
        params = config.model_dump() if hasattr(config, "model_dump") else dict(config or {})
        if model_param == "loss":  # train-head: the loss sits in its training section
            params = {**params, **(params.get("training") or {})}
        day = flow_run.scheduled_start_time.strftime("%Y-%m-%d")
        model = _short_model(str(params.get(model_param) or "")) if model_param else ""
        action = params.get("action")
        return "-".join(part for part in (kind, action, day, model) if part)

    return make
