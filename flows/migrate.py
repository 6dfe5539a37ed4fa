"""The migration window as one flow with an action: start, status, promote, rollback, finish."""

from __future__ import annotations

import os
import socket

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.build_index import build_index
from flows.naming import run_name
from flows.reencode import reencode
from imgest import encoders
from imgest.lock import StoreLock
from imgest.storage import open_location
from tasks import migration
from tasks.export import last_run
from tasks.index_store import read_alias
from tasks.report import render_window

ACTIONS = ("start", "status", "promote", "rollback", "finish")


@flow(name="migrate", flow_run_name=run_name("migrate", "to"), validate_parameters=True)
def migrate(store: str, action: str, to: str | None = None, catalogue: str | None = None,
            gate: dict | None = None, margin: float = 0.0, retain_days: float = 7.0, batch_size: str = "auto",
            device: str = "auto", kind: str = "auto", memory: str = "4G", target_recall: float = 0.95,
            shard_size: int = 2000) -> dict:
    if action not in ACTIONS:
        raise migration.MigrationError(f"unknown action {action!r}; allowed: {', '.join(ACTIONS)}")
    store_loc = open_location(store, must_exist=True, what="store")
    if action == "start":  # its re-encode and index build take the writer lock themselves
        start(store_loc, to, catalogue, batch_size, device, kind, memory, target_recall, shard_size)
    elif action in ("promote", "rollback", "finish"):
        # Alias moves and deletions hold the writer lock: a nightly build moving `serving` on the old model
        # at the same moment would otherwise overwrite the promote (or finish would delete what it reads).
        with StoreLock(store_loc, owner=f"migrate-{action}@{socket.gethostname()}:{os.getpid()}"):
            if action == "promote":
                migration.promote(store_loc, gate, margin)
            elif action == "rollback":
                migration.rollback(store_loc)
            else:
                finished = migration.finish(store_loc, retain_days)
    if action == "finish":
        create_markdown_artifact(f"Window {finished['window']['id']} finished; deleted now: "
                                 f"{finished['deleted'] or 'nothing (retention or aliases hold it)'}\n",
                                 key="migration-window")
        return {"open": False, "finished": finished}
    status = migration.window_status(store_loc)
    create_markdown_artifact(render_window(status), key="migration-window", description=f"migrate {action}")
    return status


def start(store, to: str | None, catalogue: str | None, batch_size: str, device: str, kind: str, memory: str,
          target_recall: float, shard_size: int) -> dict:
    """Open (or resume) the window, re-encode into the new namespace, build its index as `shadow`.
    Every step is idempotent, so rerunning the same command after a crash continues."""
    if not to:
        raise migration.MigrationError("migrate start needs --to MODEL")
    serving = read_alias(store, "serving")
    if serving is None:
        raise migration.MigrationError("nothing is serving yet: run `imgest nightly` first, then migrate")
    target = encoders.resolve(to)
    catalogue = catalogue or (last_run(store, serving["slug"]) or {}).get("catalogue")
    if not catalogue:
        raise migration.MigrationError("no catalogue known for the serving model; pass --catalogue")
    window = migration.open_window(store, serving["slug"], target.describe(), catalogue)
    migration.record(store, window, "reencode-started")
    summary = reencode(window["catalogue"], store.url, to, batch_size, device, shard_size)
    migration.check_window_model(window["to"]["slug"], summary)
    migration.record(store, window, "reencode-finished", encoded=summary["encoded"], run_id=summary["run_id"])
    built = build_index(store.url, target.slug, kind, memory, target_recall, alias="shadow")
    migration.record(store, window, "shadow-index", version=built.get("card", {}).get("version"))
    return window
