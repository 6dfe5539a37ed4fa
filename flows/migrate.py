"""The migration window as one flow with an action: start, status, promote, rollback, finish."""

from __future__ import annotations

from prefect.artifacts import create_markdown_artifact

from imgest import encoders
from imgest.config import IndexConfig, MigrateConfig, ReencodeConfig
from imgest.config.flow_params import configured_flow
from imgest.flows.build_index import build_index
from imgest.flows.reencode import reencode
from imgest.images import decoders
from imgest.memory import give_back
from imgest.reports.migration import render_finished, render_window
from imgest.reports.run_names import run_name
from imgest.retrieval.status import last_run
from imgest.state.aliases import read_alias
from imgest.state.lock import LOCK_WAIT_S, StoreLock, run_owner
from imgest.storage import open_location
from imgest.tasks.migration import window as migration
from imgest.tasks.sync.targets import parse_target
from imgest.tasks.sync.window import switch_targets


@configured_flow(name="migrate", flow_run_name=run_name("migrate", "to"))
def migrate(config: MigrateConfig) -> dict:
    store_loc = open_location(config.store, must_exist=True, what="store")
    for target in config.sync_to:  # a bad target URL refuses the step before anything moves
        parse_target(target)
    if config.action == "start":  # its re-encode and index build take the writer lock themselves
        migrate_start(config)
        give_back()  # the re-encode's and the build's freed memory, before the window's status reads both states
    elif config.action in ("promote", "rollback", "finish"):
        # Alias moves and deletions hold the writer lock: a nightly build moving `serving` on the old model
        # at the same moment would otherwise overwrite the promote (or finish would delete what it reads).
        with StoreLock(store_loc, owner=run_owner(f"migrate-{config.action}")) as lock:
            if config.action == "promote":
                migration.promote(store_loc, config.gate, config.margin, config.force, lock.fence,
                                  config.min_shadow_agreement)
            elif config.action == "rollback":
                migration.rollback(store_loc, lock.fence)
            else:
                finished = migration.finish(store_loc, config.retain_days, lock.fence)
    if config.action == "finish":
        create_markdown_artifact(render_finished(finished), key="migration-window")
        return {"open": False, "finished": finished}
    status = migration.window_status(store_loc)
    if config.action in ("promote", "rollback"):  # after the store's alias moved: it is what the targets follow
        status["targets"] = switch_targets(store_loc, config.sync_to)
    create_markdown_artifact(render_window(status), key="migration-window", description=f"migrate {config.action}")
    return status


@configured_flow(name="migrate-start", flow_run_name=run_name("migrate-start", "to"))
def migrate_start(config: MigrateConfig) -> dict:
    """Open (or resume) the window, re-encode into the new namespace, build its index as `shadow`.
    Every step is idempotent, so rerunning the same command after a crash continues."""
    store_loc = open_location(config.store, must_exist=True, what="store")
    serving = read_alias(store_loc, "serving")
    if serving is None:
        raise migration.MigrationError("nothing is serving yet: run `imgest nightly` first, then migrate")
    target = encoders.resolve(config.to)
    encoders.refuse_unrecordable(target, store_loc)  # before the window opens: not after a full re-encode
    if "image" in target.modalities:  # its decoder asked for (or recorded by an earlier start) can run here
        decoders.check(store_loc, target.slug, config.decoder, config.force_decoder,
                       encoders.resolve_device(config.device))
    catalogue = config.catalogue or (last_run(store_loc, serving["slug"]) or {}).get("catalogue")
    if not catalogue:
        raise migration.MigrationError("no catalogue known for the serving model; pass --catalogue")
    owner = run_owner("migrate-start")
    with StoreLock(store_loc, owner=owner, wait=LOCK_WAIT_S) as lock:  # the window is written under the lock
        window = migration.open_window(store_loc, serving["slug"], target.describe(), catalogue, lock.fence)
        migration.check_window_model(window["to"]["slug"], target)  # a resumed window: before the re-encode commits
        migration.record(store_loc, window, "reencode-started", lock.fence)
    summary = reencode(ReencodeConfig(catalogue=window["catalogue"], inventory=config.inventory, store=store_loc.url,
                                      model=config.to,
                                      batch_size=config.batch_size, device=config.device,
                                      runtime=config.runtime, precision=config.precision, shard_size=config.shard_size,
                                      decoder=config.decoder, force_decoder=config.force_decoder,
                                      keep_pixels=config.keep_pixels))
    give_back()  # a cold start's freed memory, before the build
    with StoreLock(store_loc, owner=owner, wait=LOCK_WAIT_S) as lock:
        migration.record(store_loc, window, "reencode-finished", lock.fence, encoded=summary["encoded"],
                         run_id=summary["run_id"])
    built = build_index(IndexConfig(store=store_loc.url, model=target.slug, kind=config.kind, memory=config.memory,
                                    target_recall=config.target_recall, alias="shadow", disk=config.disk))
    with StoreLock(store_loc, owner=owner, wait=LOCK_WAIT_S) as lock:
        migration.record(store_loc, window, "shadow-index", lock.fence, version=built.get("card", {}).get("version"))
    return window
