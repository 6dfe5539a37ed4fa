"""Build a versioned FAISS index of one model's live embeddings, tune it to a recall, move an alias."""

from __future__ import annotations

import faiss
from prefect import tags
from prefect.artifacts import create_markdown_artifact
from prefect.utilities.annotations import quote

from imgest.config import IndexConfig
from imgest.config.flow_params import configured_flow
from imgest.flows.build_version import build_version
from imgest.names import VERSION
from imgest.plots import markdown_image, recall_sweep_png
from imgest.reports.index import render_card
from imgest.reports.run_names import run_name
from imgest.state.live import live_fingerprint
from imgest.state.lock import StoreLock, run_owner
from imgest.state.models import default_model, find_model
from imgest.storage import open_location
from imgest.tasks.index.steps import (
    build_key,
    record_build,
    reusable_version,
    verify_and_alias_task,
    write_reference_task,
    write_version_task,
)


@configured_flow(name="build-index", flow_run_name=run_name("build-index"))
def build_index(config: IndexConfig) -> dict:
    store_loc = open_location(config.store, must_exist=True, what="store")
    card_model = find_model(store_loc, default_model(store_loc, config.model))
    config = config.model_copy(update={"model": card_model["slug"]})
    with tags(f"model:{card_model['slug']}"), \
            StoreLock(store_loc, owner=run_owner("build-index")) as lock:
        inputs = {"model_id": card_model["model_id"], "live_state": live_fingerprint(store_loc, card_model["slug"]),
                  "kind": config.kind, "memory": config.memory, "disk": config.disk,
                  "target_recall": config.target_recall, "k": config.k, "queries": config.queries,
                  "code": f"imgest {VERSION}, faiss {faiss.__version__}"}
        key = build_key(inputs)
        reused_card = None if config.rebuild else reusable_version(store_loc, card_model["slug"], key)
        reused = reused_card is not None
        if reused:
            card = reused_card
        else:
            # the store as opened (an absolute URL): parts may run on other machines and folders
            new = build_version(config.model_copy(update={"store": store_loc.url}), card_model)
            if not new["built"]:
                return {**new, "reused": False}
            card = write_version_task(store_loc.url, new["index"], quote(new["ids"]), new["card"], lock.fence,
                                      quote(new["truth"]))
            record_build(store_loc, card_model["slug"], key, inputs, card, lock.fence)
            if new.get("reference") is not None:  # trained here: later nights' new images are measured against it
                write_reference_task(store_loc.url, card, quote(new["reference"]))
        moved = verify_and_alias_task(store_loc.url, card, config.alias, lock.fence)
    markdown = ("Nothing changed since this version was built: reused, not rebuilt.\n\n" if reused else "") + \
        render_card(card)
    if card["search"]["param"]:  # an ANN index: its recall sweep, the target and the served value
        markdown += "\n\n" + markdown_image(recall_sweep_png(card), "recall sweep")
    create_markdown_artifact(markdown, key="index-card",
                             description=f"index model={card['slug']} v{card['version']:04d}")
    return {"built": True, "reused": reused, "card": card, "aliases": [a["alias"] for a in moved]}
