"""The migration window as one flow with an action: start, status, promote, rollback, finish."""

from __future__ import annotations

import os
import socket

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from imgest import encoders
from imgest.config import MigrateConfig
from imgest.defaults import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_DEVICE,
    DEFAULT_DISK,
    DEFAULT_KIND,
    DEFAULT_MEMORY,
    DEFAULT_RETAIN_DAYS,
    DEFAULT_SHARD_SIZE,
    DEFAULT_TARGET_RECALL,
)
from imgest.flows.build_index import build_index
from imgest.flows.reencode import reencode
from imgest.lock import LOCK_WAIT_S, StoreLock
from imgest.storage import open_location
from imgest.tasks import migration
from imgest.tasks.aliases import read_alias
from imgest.tasks.markdown import render_finished, render_window
from imgest.tasks.run_names import run_name
from imgest.tasks.status import last_run


@flow(name="migrate", flow_run_name=run_name("migrate", "to"), validate_parameters=True)
def migrate(store: str, action: str, to: str | None = None, catalogue: str | None = None,
            gate: dict | None = None, margin: float = 0.0, force: str | None = None,
            retain_days: float = DEFAULT_RETAIN_DAYS, batch_size: str = DEFAULT_BATCH_SIZE,
            device: str = DEFAULT_DEVICE, kind: str = DEFAULT_KIND,
            memory: str = DEFAULT_MEMORY, target_recall: float = DEFAULT_TARGET_RECALL,
            shard_size: int = DEFAULT_SHARD_SIZE, disk: str = DEFAULT_DISK) -> dict:
    cfg = MigrateConfig(store=store, action=action, to=to, catalogue=catalogue, gate=gate, margin=margin,
                        force=force, retain_days=retain_days, batch_size=batch_size, device=device, kind=kind,
                        memory=memory, target_recall=target_recall, shard_size=shard_size, disk=disk)
    store_loc = open_location(cfg.store, must_exist=True, what="store")
    if cfg.action == "start":  # its re-encode and index build take the writer lock themselves
        migrate_start(store=cfg.store, to=cfg.to, catalogue=cfg.catalogue, batch_size=cfg.batch_size,
                      device=cfg.device, kind=cfg.kind, memory=cfg.memory, target_recall=cfg.target_recall,
                      shard_size=cfg.shard_size, disk=cfg.disk)
    elif cfg.action in ("promote", "rollback", "finish"):
        # Alias moves and deletions hold the writer lock: a nightly build moving `serving` on the old model
        # at the same moment would otherwise overwrite the promote (or finish would delete what it reads).
        with StoreLock(store_loc, owner=f"migrate-{cfg.action}@{socket.gethostname()}:{os.getpid()}") as lock:
            if cfg.action == "promote":
                migration.promote(store_loc, cfg.gate, cfg.margin, cfg.force, lock.fence)
            elif cfg.action == "rollback":
                migration.rollback(store_loc, lock.fence)
            else:
                finished = migration.finish(store_loc, cfg.retain_days, lock.fence)
    if cfg.action == "finish":
        create_markdown_artifact(render_finished(finished), key="migration-window")
        return {"open": False, "finished": finished}
    status = migration.window_status(store_loc)
    create_markdown_artifact(render_window(status), key="migration-window", description=f"migrate {cfg.action}")
    return status


@flow(name="migrate-start", flow_run_name=run_name("migrate-start", "to"), validate_parameters=True)
def migrate_start(store: str, to: str, catalogue: str | None = None, batch_size: str = DEFAULT_BATCH_SIZE,
                  device: str = DEFAULT_DEVICE, kind: str = DEFAULT_KIND, memory: str = DEFAULT_MEMORY,
                  target_recall: float = DEFAULT_TARGET_RECALL, shard_size: int = DEFAULT_SHARD_SIZE,
                  disk: str = DEFAULT_DISK) -> dict:
    """Open (or resume) the window, re-encode into the new namespace, build its index as `shadow`.
    Every step is idempotent, so rerunning the same command after a crash continues."""
    cfg = MigrateConfig(store=store, action="start", to=to, catalogue=catalogue, batch_size=batch_size,
                        device=device, kind=kind, memory=memory, target_recall=target_recall, shard_size=shard_size,
                        disk=disk)
    store_loc = open_location(cfg.store, must_exist=True, what="store")
    serving = read_alias(store_loc, "serving")
    if serving is None:
        raise migration.MigrationError("nothing is serving yet: run `imgest nightly` first, then migrate")
    target = encoders.resolve(cfg.to)
    catalogue = cfg.catalogue or (last_run(store_loc, serving["slug"]) or {}).get("catalogue")
    if not catalogue:
        raise migration.MigrationError("no catalogue known for the serving model; pass --catalogue")
    owner = f"migrate-start@{socket.gethostname()}:{os.getpid()}"
    with StoreLock(store_loc, owner=owner, wait=LOCK_WAIT_S) as lock:  # the window is written under the lock
        window = migration.open_window(store_loc, serving["slug"], target.describe(), catalogue, lock.fence)
        migration.record(store_loc, window, "reencode-started", lock.fence)
    summary = reencode(catalogue=window["catalogue"], store=store_loc.url, model=cfg.to,
                       batch_size=cfg.batch_size,
                       device=cfg.device, shard_size=cfg.shard_size)
    migration.check_window_model(window["to"]["slug"], summary)
    with StoreLock(store_loc, owner=owner, wait=LOCK_WAIT_S) as lock:
        migration.record(store_loc, window, "reencode-finished", lock.fence, encoded=summary["encoded"],
                         run_id=summary["run_id"])
    built = build_index(store=store_loc.url, model=target.slug, kind=cfg.kind, memory=cfg.memory,
                        target_recall=cfg.target_recall, alias="shadow", disk=cfg.disk)
    with StoreLock(store_loc, owner=owner, wait=LOCK_WAIT_S) as lock:
        migration.record(store_loc, window, "shadow-index", lock.fence, version=built.get("card", {}).get("version"))
    return window
