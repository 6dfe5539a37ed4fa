"""Model lookup: the models a store holds (their `model.json`), found by name, model id or slug."""

from __future__ import annotations

from imgest.storage import Location


class ModelNotFoundError(LookupError):
    """The store has no model of that name; the message lists the ones it has."""


def find_model(store: Location, model: str) -> dict:
    """Match a model by slug, model id or name (``efficientnet-lite0``), among those in the store."""
    models = list_models(store)
    exact = [m for m in models if model in (m["slug"], m["model_id"])]
    by_name = [m for m in models if m["name"] == model]
    found = exact or by_name
    if len(found) == 1:
        return found[0]
    have = ", ".join(f"{m['name']} ({m['slug']})" for m in models) or "none"
    if not found:
        raise ModelNotFoundError(f"store {store.url} has no model {model!r}; models in the store: {have}")
    raise ModelNotFoundError(f"model {model!r} is ambiguous in {store.url} (weights changed between runs); "
                             f"name one by its slug: {have}")


def list_models(store: Location) -> list[dict]:
    models = []
    for name in store.list_names("state"):
        if name.startswith("model="):
            key = f"state/{name}/model.json"
            if store.exists(key):
                models.append(store.read_json(key))
    return models
