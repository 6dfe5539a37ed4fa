"""Model lookup: the models a store holds (their `model.json`), found by name, model id or slug, and the one a
command works on when it names none."""

from __future__ import annotations

import logging

from imgest import encoders
from imgest.errors import UserError
from imgest.names import DEFAULT_MODEL
from imgest.state import layout
from imgest.state.aliases import read_alias
from imgest.storage import Location, RecordError, records


class ModelNotFoundError(UserError, LookupError):
    """The store has no model of that name; the message lists the ones it has."""


def find_model(store: Location, model: str) -> dict:
    """Match a model by slug, model id or name (``efficientnet-lite0``), among those in the store."""
    left_out: dict[str, str] = {}
    models = list_models(store, left_out)
    exact = [m for m in models if model in (m["slug"], m["model_id"])]
    by_name = [m for m in models if m["name"] == model]
    found = exact or by_name
    if len(found) == 1:
        return found[0]
    have = ", ".join(f"{m['name']} ({m['slug']})" for m in models) or "none"
    if not found and model in left_out:  # the reason it was left out is the error, not a warning above it
        raise ModelNotFoundError(f"store {store.url}: model {model!r} is there but cannot be used: {left_out[model]}")
    if not found:
        others = "".join(f"; left out: {slug} ({why})" for slug, why in left_out.items())
        raise ModelNotFoundError(f"store {store.url} has no model {model!r}; models in the store: {have}{others}")
    raise ModelNotFoundError(f"model {model!r} is ambiguous in {store.url} (weights changed between runs); "
                             f"name one by its slug: {have}")


def default_model(store: Location, model: str | None, *, flag: str = "--model", field: str = "slug",
                  base: bool = False) -> str:
    """The model a command works on: ``model`` when one is named (it always wins); else the store's own, its
    only model or, of several, the one the `serving` alias points at (its ``field``: the slug `find_model`
    takes, or the name an ingest resolves); DEFAULT_MODEL for a store that holds none, so that such a store
    ingests it and other commands refuse as they did. Several and no serving alias among them:
    ModelNotFoundError in one line listing them and naming ``flag``. With ``base`` (a new head's base is asked
    for), a head found this way gives its own base's slug: a head is trained on a base model, not on a head."""
    if model is not None:
        return model
    models = list_models(store)
    if not models:
        return DEFAULT_MODEL
    serving = read_alias(store, "serving") if len(models) > 1 else None
    chosen = models[0] if len(models) == 1 else \
        next((m for m in models if serving is not None and m["slug"] == serving["slug"]), None)
    if chosen is None:
        have = ", ".join(f"{m['name']} ({m['slug']})" for m in models)
        why = "no serving alias" if serving is None else \
            f"its serving alias points at model={serving['slug']}, not one of them"
        raise ModelNotFoundError(f"store {store.url} holds {len(models)} models and {why}: pass {flag} with one "
                                 f"of {have}")
    return chosen["base"]["slug"] if base and chosen.get("base") else chosen[field]


def list_models(store: Location, left_out: dict[str, str] | None = None) -> list[dict]:
    """The models of the store whose model.json is well-formed: its slug the folder's, its name one this
    installation has (`encoders.recorded`). Any other is left out with a warning (and its reason in
    `left_out`, by slug, when given): never a URL to open."""
    models = []
    for name in store.list_names(layout.STATE):
        if name.startswith(layout.MODEL):
            slug = name.removeprefix(layout.MODEL)
            key = layout.file_in(layout.file_in(layout.STATE, name), layout.MODEL_RECORD)
            if store.exists(key):
                try:
                    models.append(checked_model(store, key, slug))
                except (RecordError, encoders.EncoderError) as exc:
                    logging.getLogger("imgest").warning("model %s left out: %s", key, exc)
                    if left_out is not None:
                        left_out[slug] = str(exc)
    return models


def read_model(store: Location, slug: str) -> dict | None:
    """A model's record (None when the store has none), checked like `list_models` checks it."""
    key = layout.model_key(slug)
    return checked_model(store, key, slug) if store.exists(key) else None


def checked_model(store: Location, key: str, slug: str) -> dict:
    """model.json with its slug the folder's and its name one this installation has (RecordError or
    EncoderError otherwise); a head's base, when it has one, a well-formed slug."""
    where = f"{store.url}: {key}"
    model = store.read_json(key)
    if records.slug(records.field(model, "slug", str, where), where) != slug:
        raise RecordError(f"{where}: describes model={model['slug']}, not the folder it is in")
    records.field(model, "model_id", str, where)
    model["name"] = encoders.recorded(model.get("name"), store, where)
    if model.get("base") is not None:
        records.slug(records.field(records.field(model, "base", dict, where), "slug", str, where), f"{where}: base")
    return model
