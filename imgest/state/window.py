"""The open model-migration window's record, read and checked for whoever needs to know what a window is moving.

  migration/window.json          the open window (created exclusively: two cannot be open at once)
"""

from __future__ import annotations

from imgest.state.layout import WINDOW_KEY
from imgest.storage import Location, records


def read_window(store: Location) -> dict | None:
    """The open window, its two sides checked (a model name and slug each) before anything uses them."""
    if not store.exists(WINDOW_KEY):
        return None
    window, where = store.read_json(WINDOW_KEY), f"{store.url}: {WINDOW_KEY}"
    for side in ("from", "to"):
        records.field(window, side, dict, where)
        records.field(window[side], "name", str, f"{where}: {side}")
        records.slug(window[side].get("slug"), f"{where}: {side}.slug")
    for name in ("id", "status"):
        records.field(window, name, str, where)
    return window
