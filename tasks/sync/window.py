"""Sync targets through a migration window: which models a night syncs, and the switch promote and rollback make."""

from __future__ import annotations

from imgest.config import SyncConfig
from imgest.state import layout
from imgest.state.aliases import read_alias
from imgest.state.window import read_window
from imgest.storage import Location
from imgest.tasks.sync import watermark
from imgest.tasks.sync.run import sync_task
from imgest.tasks.sync.targets import parse_target


def window_companions(store: Location) -> list[str]:
    """While a window is open, its model `serving` does not point at (the candidate, or after a promote the old
    model): synced beside serving, into its own collection, so a promote or rollback only moves the name."""
    window, serving = read_window(store), read_alias(store, "serving")
    if window is None:
        return []
    return [window[side]["slug"] for side in ("from", "to") if serving is None or window[side]["slug"] !=
            serving["slug"]]


def switch_targets(store: Location, targets: tuple[str, ...]) -> dict:
    """Each target's name moved to the model now serving: a sync of that model (only what changed since its
    last one, none when the nightly synced both) ending with the switch. A target that fails is recorded in one
    line and the move stands; the next nightly switches it. Targets this store synced but that were not named
    are listed by their folder, never contacted (a URL read from a store is not trusted to connect to)."""
    switched = [sync_task(SyncConfig(store=store.url, to=target, alias="serving")) for target in targets]
    named = {parse_target(target).slug for target in targets}
    others = [slug for slug in store.list_names(layout.SYNC) if slug not in named and
              watermark.synced_models(store, slug)]
    return {"switched": switched, "not_switched": sorted(others)}
