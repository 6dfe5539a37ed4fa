"""Aliases: a name (`serving`, `shadow`, `previous`) pointing at one index version, moved in one atomic write.

  aliases/<name>.json   {alias, slug, model_id, version, sha256, updated, reason} plus the last 50 targets
"""

from __future__ import annotations

from imgest.errors import UserError
from imgest.names import ALIAS_NAME
from imgest.state import layout
from imgest.state.clock import now_iso
from imgest.state.lock import Fence, fenced_delete, fenced_write
from imgest.storage import Location, records


class AliasError(UserError, ValueError):
    """An alias name outside the grammar; the message says what names may be."""


def alias_key(name: str) -> str:
    if not isinstance(name, str) or not ALIAS_NAME.match(name):
        raise AliasError(f"alias names are lowercase letters, digits, '-' and '_' (start with a letter, at most 63); "
                         f"got {str(name)[:80]!r}")
    return layout.alias_key(name)


def _checked(store: Location, key: str) -> dict:
    """An alias record with its target's slug, version and checksum well-formed (RecordError otherwise)."""
    return records.target(store.read_json(key), f"{store.url}: {key}")


def read_alias(store: Location, name: str) -> dict | None:
    key = alias_key(name)
    return _checked(store, key) if store.exists(key) else None


def list_aliases(store: Location) -> dict[str, dict]:
    names = [n[:-5] for n in store.list_names(layout.ALIASES) if n.endswith(".json") and ALIAS_NAME.match(n[:-5])]
    return {n: _checked(store, layout.alias_key(n)) for n in names}


def set_alias(store: Location, name: str, card: dict, reason: str, fence: Fence | None = None) -> dict:
    """Point ``name`` at a complete version in one atomic write; the previous target joins the history.
    Fenced: the write happens only if the alias is still the version read here (RecordChangedError otherwise)."""
    _, token = store.read_versioned(alias_key(name))  # before the read below: a change after it fails the write
    current = read_alias(store, name)
    if current and (current["slug"], current["version"], current["sha256"]) == \
            (card["slug"], card["version"], card["sha256"]):
        return current  # already there (a reused build): no write, no history entry
    history = []
    if current:
        history = current.pop("history", [])[-49:] + [current]
    entry = {"alias": name, "slug": card["slug"], "model_id": card["model_id"], "version": card["version"],
             "sha256": card["sha256"], "updated": now_iso(), "reason": reason, "history": history}
    fenced_write(store, alias_key(name), entry, token, fence)
    return entry


def delete_alias(store: Location, name: str, fence: Fence | None = None) -> bool:
    """Remove an alias, fenced like a move: only if it is still the version read here. False: there was none."""
    key = alias_key(name)
    _, token = store.read_versioned(key)
    if token is None:
        return False
    fenced_delete(store, key, token, fence)
    return True


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
