"""Aliases: a name (`serving`, `shadow`, `previous`) pointing at one index version, moved in one atomic write.

  aliases/<name>.json   {alias, slug, model_id, version, sha256, updated, reason} plus the last 50 targets
"""

from __future__ import annotations

import re

from imgest.lock import Fence
from imgest.storage import Location
from imgest.tasks.state import now_iso

ALIAS_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")


def alias_key(name: str) -> str:
    if not ALIAS_NAME.match(name):
        raise ValueError(f"alias names are lowercase letters, digits, '-' and '_' (start with a letter); got {name!r}")
    return f"aliases/{name}.json"


def read_alias(store: Location, name: str) -> dict | None:
    key = alias_key(name)
    return store.read_json(key) if store.exists(key) else None


def list_aliases(store: Location) -> dict[str, dict]:
    names = [n[:-5] for n in store.list_names("aliases") if n.endswith(".json")]
    return {n: store.read_json(f"aliases/{n}.json") for n in names}


def set_alias(store: Location, name: str, card: dict, reason: str, fence: Fence | None = None) -> dict:
    """Point ``name`` at a complete version in one atomic write; the previous target joins the history."""
    current = read_alias(store, name)
    if current and (current["slug"], current["version"], current["sha256"]) == \
            (card["slug"], card["version"], card["sha256"]):
        return current  # already there (a reused build): no write, no history entry
    history = []
    if current:
        history = current.pop("history", [])[-49:] + [current]
    entry = {"alias": name, "slug": card["slug"], "model_id": card["model_id"], "version": card["version"],
             "sha256": card["sha256"], "updated": now_iso(), "reason": reason, "history": history}
    if fence is not None:
        fence.check(store)
    store.write_json(alias_key(name), entry)
    return entry


def aliases_to_move(store: Location, slug: str, alias: str | None) -> list[str]:
    """'auto': every alias already on this model follows its rebuilds, and `serving` is created when
    the store has none; a name: that alias too; None: no alias moves."""
    if alias is None:
        return []
    names = set(follower_aliases(store, slug))
    if alias == "auto":
        if read_alias(store, "serving") is None:
            names.add("serving")
    else:
        names.add(alias)
    return sorted(names)


def follower_aliases(store: Location, slug: str) -> list[str]:
    return sorted(name for name, entry in list_aliases(store).items() if entry["slug"] == slug)
