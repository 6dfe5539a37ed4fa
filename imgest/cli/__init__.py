"""The `imgest` command line; commands live in the modules of this package, by concern."""

from __future__ import annotations

import os

# Prefect's ephemeral server must work offline and may take a while to start on a small machine.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

# Registers the commands on `app` (each module imports it from imgest.cli.app).
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
from imgest.cli.app import app  # noqa: E402

__all__ = ["app"]
