"""Retention: models retired by a finished migration window are deleted once due and no alias needs them.

  migration/retire/<slug>.json   {slug, retire_after, window[, deleted_at]}: a model whose data may go

A retirement record is checked before it can delete anything (its slug is the one its key names, so never
a path); a malformed one deletes nothing and is logged for a person to look at.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from imgest.state import layout
from imgest.state.aliases import list_aliases
from imgest.state.layout import embeddings_prefix, index_prefix, pixels_prefix, state_prefix
from imgest.state.lock import Fence
from imgest.state.models import read_model
from imgest.storage import Location, RecordError, records


def needed_slugs(store: Location) -> set[str]:
    """Models an alias points at, and the base models of those that are heads (a head's future shards
    are derived from its base's embeddings, and retraining it needs them)."""
    pointed = {a["slug"] for a in list_aliases(store).values()}
    needed = set(pointed)
    for slug in pointed:
        model = read_model(store, slug)
        if model and model.get("base"):
            needed.add(model["base"]["slug"])
    return needed


def retirement(store: Location, name: str) -> dict:
    """A retirement record checked before it can delete anything: its slug is the one its key names (a model
    slug, so never a path), its date a date with a timezone."""
    key = layout.file_in(layout.RETIRED, name)
    where = f"{store.url}: {key}"
    entry = store.read_json(key)
    slug = records.slug(records.field(entry, "slug", str, where), f"{where}: slug")
    if f"{slug}.json" != name:
        raise RecordError(f"{where}: names model={slug[:80]}, not the model its key names: refused")
    due = datetime.fromisoformat(records.field(entry, "retire_after", str, where))
    if due.tzinfo is None:
        raise RecordError(f"{where}: retire_after {entry['retire_after']!r} has no timezone")
    return {**entry, "due": due}


def collect_retired(store: Location, fence: Fence | None = None, now: datetime | None = None) -> list[str]:
    """Delete retired models past their date, never while an alias needs them (directly or as a head's base).
    A malformed retirement record deletes nothing: it is skipped with a warning, for a person to look at.
    `now`: the time the dates are judged at and the deletion is stamped with (the wall clock when None)."""
    deleted = []
    now = now or datetime.now(UTC)
    pointed = needed_slugs(store)
    for name in retired_names(store):
        try:
            entry = retirement(store, name)
        except (RecordError, ValueError) as exc:
            logging.getLogger("imgest").warning("retention: skipped %s: %s", name, exc)
            continue
        if entry["due"] > now or entry["slug"] in pointed or entry.get("deleted_at"):
            continue
        if fence is not None:
            fence.check(store)
        for prefix in (embeddings_prefix(entry["slug"]), index_prefix(entry["slug"]), state_prefix(entry["slug"]),
                       layout.tuning_prefix(entry['slug']), pixels_prefix(entry["slug"])):
            store.delete_tree(prefix)
        # the record stays: a retired model is never ingested again unless a new window migrates to it
        entry.pop("due")
        deleted_at = now.isoformat(timespec="seconds")
        store.write_json(layout.file_in(layout.RETIRED, name), {**entry, "deleted_at": deleted_at})
        deleted.append(entry["slug"])
    return deleted


def retired_names(store: Location) -> list[str]:
    return [n for n in store.list_names(layout.RETIRED) if n.endswith(".json") and records.SLUG.match(n[:-5])]


def retired_slugs(store: Location) -> set[str]:
    """Models a finished window retired (their data deleted or due to be): never ingested again by a nightly."""
    return {name.removesuffix(".json") for name in retired_names(store)}
