"""Store status: per model, live items, shards, rejects, tombstones, snapshot and last run; who is writing; the
index version `serving` points at and what encoded its vectors."""

from __future__ import annotations

from imgest.images import decoders
from imgest.retrieval.versions import IndexIntegrityError, IndexNotFoundError, read_card
from imgest.state import layout, pixels
from imgest.state.aliases import read_alias
from imgest.state.committed import DELETED, FAILED, LIVE, REJECTED, latest_snapshot_seq, load_state
from imgest.state.lock import current_holder
from imgest.state.models import list_models
from imgest.storage import Location, open_location
from imgest.storage.records import RecordError


def last_run(store: Location, slug: str) -> dict | None:
    runs = [n for n in store.list_names(layout.RUNS) if n.endswith(".json")]
    for name in sorted(runs, reverse=True):
        summary = store.read_json(layout.file_in(layout.RUNS, name))
        if summary.get("slug") == slug:
            return {k: v for k, v in summary.items() if k not in ("rejected_items", "removed_orphans", "parameters")}
    return None


def model_decoder(store: Location, slug: str) -> dict | None:
    """The model's JPEG decode as its record says: `describe` ("simplejpeg (default, run r...), down to a shorter
    side of 256 px"), the decoder, the side (0: whole images; None: not recorded yet, the next run records it), how
    it was chosen, whether the decoder is the model's default, and the side gate's figures; None without a record.
    A record that does not read says so (it is read from the store: a registered name or nothing)."""
    try:
        record = decoders.read_record(store, slug)
    except decoders.DecoderError as exc:
        return {"describe": f"unreadable: {exc}"}
    if record is None:
        return None
    note = "" if record.decoder == decoders.DEFAULT else \
        f"; not the model's default ({decoders.DEFAULT}): --decoder {decoders.DEFAULT} switches, behind the gate"
    if record.side == decoders.UNRECORDED:
        note += "; decode side not recorded yet (the next run records the one its vectors were made at)"
    elif record.side == decoders.FULL and record.side_gate and not record.side_gate.get("passed", True):
        note += (f"; whole images: the reduced decode failed its gate against the whole image (mean cosine "
                 f"{record.side_gate.get('mean_cosine')}, p1 {record.side_gate.get('p1_cosine')})")
    return {"describe": record.describe() + note, "decoder": record.decoder, "how": record.how,
            "side": None if record.side == decoders.UNRECORDED else record.side,
            "default_decoder": record.decoder == decoders.DEFAULT, "side_gate": record.side_gate}


def model_status(store: Location, card: dict) -> dict:
    slug = card["slug"]
    state = load_state(store, slug)

    def reasons(status: str) -> list[dict]:  # rejects and failures: few, listed one by one
        return state.query("SELECT item_id, reason FROM state WHERE status = ? ORDER BY item_id", [status]).to_pylist()

    return {
        "name": card["name"],
        "model_id": card["model_id"],
        "slug": slug,
        "dim": card["dim"],
        "live": state.count(LIVE),
        "shards": state.query(f"SELECT count(DISTINCT shard) AS n FROM state WHERE status = '{LIVE}'")["n"][0].as_py(),
        "rejected": reasons(REJECTED),
        "failed": reasons(FAILED),  # transient: read again on the next run
        "tombstones": state.count(DELETED),
        "snapshot": latest_snapshot_seq(store, slug),
        "pending_shards": len(state.pending),  # committed by a run that did not finish; folded next run
        "last_run": last_run(store, slug),
        "decoder": model_decoder(store, slug),  # what decodes its JPEGs; the serving index's `decoded_by`: the mix
        "kept_pixels": pixels.coverage(store, slug, state),  # copies a later model reads instead of the catalogue
    }


def serving_index(store: Location) -> dict | None:
    """The version the `serving` alias points at, with its vector count, `encoded_by` (its card's rows per runtime
    and precision) and `decoded_by` (per JPEG decoder); None without the alias, {"error": ...} when it or its card
    does not read."""
    try:
        alias = read_alias(store, "serving")
        if alias is None:
            return None
        card = read_card(store, alias["slug"], alias["version"])
    except (RecordError, IndexNotFoundError, IndexIntegrityError) as exc:  # said, not fatal: status is for looking
        return {"error": str(exc)}
    n = card.get("n")
    return {"slug": alias["slug"], "version": alias["version"], "n": n if type(n) is int else None,
            "encoded_by": card.get("encoded_by"), "decoded_by": card.get("decoded_by")}


def store_status(store_url: str) -> dict:
    store = open_location(store_url, must_exist=True, what="store")
    lock = current_holder(store)
    return {
        "store": store.url,
        "running": {k: lock[k] for k in ("owner", "host", "pid", "started")} if lock else None,
        "serving": serving_index(store),
        "models": [model_status(store, card) for card in list_models(store)],
    }
