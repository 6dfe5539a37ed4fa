"""The model-migration window: its state in the store, coverage, and the alias moves it allows.

  migration/window.json          the open window (created exclusively: two cannot be open at once)
  migration/history/<id>.json    closed windows
  migration/retire/<slug>.json   a model whose data may be deleted after a date (see imgest/state/retention.py)
"""

from __future__ import annotations

import getpass
import json
import secrets
import socket
from datetime import UTC, datetime, timedelta

from imgest.encoders import EncoderSpec
from imgest.errors import UserError
from imgest.events import emit
from imgest.retrieval.versions import list_versions, open_index, read_card
from imgest.state import layout
from imgest.state.aliases import delete_alias, list_aliases, read_alias, set_alias
from imgest.state.clock import now_iso
from imgest.state.committed import latest_snapshot_seq
from imgest.state.layout import WINDOW_KEY, embeddings_prefix, index_prefix, pixels_prefix, state_prefix
from imgest.state.lock import Fence, RecordChangedError, fenced_delete, fenced_write
from imgest.state.models import find_model, read_model
from imgest.state.retention import collect_retired, retired_slugs
from imgest.state.shadow import check_agreement
from imgest.state.shadow import summary as shadow_summary
from imgest.state.window import read_window
from imgest.storage import Location
from imgest.tasks.migration.coverage import coverage


class MigrationError(UserError, RuntimeError):
    """A migration step is not allowed now; the message says why and what would make it allowed."""


def _check(store: Location, fence: Fence | None) -> None:
    if fence is not None:
        fence.check(store)


def _stored_version(store: Location, window: dict, fence: Fence | None) -> str:
    """The version token of the window record, which must still be ``window`` (the same id): a window finished
    or replaced since this step read it is never written back."""
    data, token = store.read_versioned(WINDOW_KEY)
    try:
        stored = json.loads(data) if data is not None else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        stored = None
    if not isinstance(stored, dict) or stored.get("id") != window["id"]:
        _check(store, fence)  # when a successor finished or replaced it, say that
        raise RecordChangedError(f"store {store.url}: the migration window {window['id']} is no longer the open "
                                 "one (finished or replaced since this step read it); nothing was recorded")
    return token


def _save(store: Location, window: dict, fence: Fence | None = None) -> dict:
    """Replace the window record: a compare-and-swap on the version read here, after the fence check, so a
    writer paused between its check and its write cannot overwrite what its successor recorded."""
    fenced_write(store, WINDOW_KEY, window, _stored_version(store, window, fence), fence)
    return window


def record(store: Location, window: dict, event: str, fence: Fence | None = None, **details) -> dict:
    window.setdefault("events", []).append({"at": now_iso(), "event": event, **details})
    return _save(store, window, fence)


def open_window(store: Location, serving_slug: str, target: dict, catalogue: str | None,
                fence: Fence | None = None) -> dict:
    """Open a window from the serving model to ``target``; rerunning the same start resumes it."""
    current = read_window(store)
    if current is not None:
        if current["to"]["slug"] == target["slug"]:
            return current
        raise MigrationError(f"a migration window is already open ({current['from']['name']} -> "
                             f"{current['to']['name']}, since {current['opened_at']}); promote, roll back or "
                             "finish it before opening another")
    source = find_model(store, serving_slug)
    if source["slug"] == target["slug"]:
        raise MigrationError(f"{target['name']} is already the serving model; nothing to migrate to")
    window = {
        "id": f"w-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}",
        "from": {k: source[k] for k in ("name", "slug", "model_id", "dim")},
        "to": {k: target[k] for k in ("name", "slug", "model_id", "dim")},
        "catalogue": catalogue,
        "opened_by": f"{getpass.getuser()}@{socket.gethostname()}",
        "opened_at": now_iso(),
        "status": "open",
        "events": [],
    }
    try:
        fenced_write(store, WINDOW_KEY, window, None, fence)  # only where no window is: never over another
    except RecordChangedError:
        _check(store, fence)
        return open_window(store, serving_slug, target, catalogue, fence)  # another start won the race
    store.delete(layout.retired_key(target['slug']))  # migrating back to a retired model revives it
    _announce("imgest.migration.opened", store, window, window["to"]["slug"])
    return window


def require_window(store: Location) -> dict:
    window = read_window(store)
    if window is None:
        raise MigrationError(f"no migration window is open in {store.url}; start one with `imgest migrate start`")
    return window


def index_current(store: Location, slug: str) -> dict:
    """The newest complete index version of a model, and whether it was built from the latest snapshot."""
    versions = list_versions(store, slug)
    if not versions:
        return {"version": None, "current": False, "reason": "no complete index"}
    card = read_card(store, slug, versions[-1])
    snapshot = latest_snapshot_seq(store, slug)
    current = card["snapshot"] == snapshot
    return {"version": versions[-1], "snapshot": card["snapshot"], "latest_snapshot": snapshot, "current": current,
            "recall": card["recall"], "encoded_by": card.get("encoded_by"),
            "reason": "" if current else f"built from snapshot {card['snapshot']}, latest is {snapshot}"}


def storage_bytes(store: Location, slug: str) -> dict:
    sizes = {}
    for name, prefix in (("shards", embeddings_prefix(slug)), ("indexes", index_prefix(slug)),
                         ("state", state_prefix(slug)), ("kept pixels", pixels_prefix(slug))):
        sizes[name] = sum(obj.size for obj in store.walk(prefix))
    sizes["total"] = sum(sizes.values())
    return sizes


def window_status(store: Location) -> dict:
    window = read_window(store)
    if window is None:
        return {"open": False}
    aliases = {name: {"slug": a["slug"], "version": a["version"]} for name, a in list_aliases(store).items()}
    return {
        "open": True,
        "store": store.url,
        "window": {k: v for k, v in window.items() if k != "events"},
        "events": window.get("events", [])[-10:],
        "coverage": coverage(store, window),
        "index": {side: index_current(store, window[side]["slug"]) for side in ("from", "to")},
        "aliases": aliases,
        "evaluation": window.get("evaluation"),
        "shadow": shadow_summary(store, window["id"]),
        "storage": {side: storage_bytes(store, window[side]["slug"]) for side in ("from", "to")},
    }


def _latest_card(store: Location, slug: str) -> dict:
    versions = list_versions(store, slug)
    if not versions:
        raise MigrationError(f"model={slug} has no complete index")
    return read_card(store, slug, versions[-1])


def check_gate(gate: dict, margin: float, aliases: dict[str, dict] | None = None) -> str | None:
    """Refuse promotion when the new model is worse than serving by more than ``margin``.

    Reads the JSON of ``imgest eval --alias serving --compare shadow`` (or the reverse: sides are found by
    alias; the gated metric is its ``metric``, recall at the largest K). With `aliases` (the store's), an
    evaluation of other index versions than the aliases point at now is refused: the proof must be about what
    would be served. Returns the refusal reason, or None.
    """
    if "a" not in gate or "b" not in gate:
        raise MigrationError("the gate file must be the JSON `imgest eval --alias serving --compare shadow --json` "
                             "writes (a hand-written pair of numbers is not an evaluation)")
    sides = {gate[s].get("alias"): gate[s] for s in ("a", "b")}
    if set(sides) != {"serving", "shadow"}:
        raise MigrationError("the gate file must compare --alias serving against --compare shadow")
    for measured in sides.values():
        now = (aliases or {}).get(measured["alias"])
        if now is not None and "version" in measured and \
                (measured.get("slug"), measured["version"]) != (now["slug"], now["version"]):
            raise MigrationError(
                f"the gate file measured {measured['alias']} = model={measured.get('slug')} "
                f"v{measured['version']}, but it now points at model={now['slug']} v{now['version']}: "
                "evaluate the indexes that would be served again")
    metric = gate.get("metric", "recall@10")
    old, new = float(sides["serving"]["metrics"][metric]), float(sides["shadow"]["metrics"][metric])
    if new < old - margin:
        return f"shadow {metric} {new:.4f} is worse than serving {old:.4f} by more than the margin {margin}"
    return None


def evaluates_window(store: Location, report: dict) -> bool:
    """A serving-vs-shadow evaluation while a window is open (the one the window keeps)."""
    return "b" in report and {report["a"]["alias"], report["b"]["alias"]} == {"serving", "shadow"} \
        and read_window(store) is not None


def evaluation_record(report: dict, source: str) -> dict:
    """What the window keeps of a serving-vs-shadow evaluation: the metric on each side, the paired bootstrap
    interval of (b - a), the query set it was measured on and the index versions it measured."""
    metric = report["metric"]
    interval = report.get("compare", {}).get("bootstrap", {}).get(metric, {})
    return {"at": now_iso(), "source": source, "metric": metric, "queries": report.get("queries"),
            "query_file": report.get("query_file"), "query_sha256": report.get("query_sha256"),
            report["a"]["alias"]: report["a"]["metrics"][metric],
            report["b"]["alias"]: report["b"]["metrics"][metric],
            "interval": {"of": f"{report['b']['alias']} - {report['a']['alias']}",
                         **{k: interval[k] for k in ("low", "high") if k in interval}},
            "versions": {report[s]["alias"]: {"slug": report[s].get("slug"), "version": report[s]["version"]}
                         for s in ("a", "b") if "version" in report[s]}}


def record_evaluation(store: Location, report: dict, fence: Fence | None = None) -> None:
    """Keep the latest serving-vs-shadow evaluation in the open window (for status and promote)."""
    window = read_window(store)
    if not evaluates_window(store, report):
        return
    window["evaluation"] = evaluation_record(report, "imgest eval")
    _save(store, window, fence)


def check_evaluation(evaluation: dict | None, margin: float, aliases: dict[str, dict]) -> str | None:
    """The window's recorded evaluation as proof for a promote: present, about the index versions the aliases
    point at now, and shadow not worse than serving beyond `margin`. Returns the refusal reason, or None."""
    if evaluation is None:
        return ("no evaluation of shadow against serving is recorded in the window: run `imgest eval --store S "
                "--queries LABELLED.jsonl --alias serving --compare shadow` (it is recorded), then promote; or "
                "promote with --force \"reason\"")
    for alias, measured in evaluation.get("versions", {}).items():
        now = aliases.get(alias)
        if now is not None and (measured["slug"], measured["version"]) != (now["slug"], now["version"]):
            return (f"the recorded evaluation measured {alias} = model={measured['slug']} v{measured['version']}, "
                    f"but it now points at model={now['slug']} v{now['version']}: evaluate again")
    metric, old, new = evaluation["metric"], float(evaluation["serving"]), float(evaluation["shadow"])
    if new < old - margin:
        low, high = evaluation["interval"].get("low"), evaluation["interval"].get("high")
        span = f" (paired bootstrap interval of {evaluation['interval']['of']}: [{low}, {high}])" if low is not None \
            else ""
        return (f"shadow {metric} {new:.4f} is worse than serving {old:.4f} by more than the margin {margin} on "
                f"{evaluation.get('query_file')}{span}")
    return None


def promote(store: Location, gate: dict | None = None, margin: float = 0.0, force: str | None = None,
            fence: Fence | None = None, min_shadow_agreement: float | None = None) -> dict:
    """serving -> the new model's newest verified index; the old target is kept as `previous`.

    Coverage and a current, verified index are always required. The proof of quality is an evaluation of
    shadow against serving recorded in the window (by `imgest eval`, or the `gate` report, which is recorded
    first); `force` (a reason) promotes without it, and the reason is kept in the window and the alias history."""
    window = require_window(store)
    if window["status"] == "promoted":
        return window
    cov = coverage(store, window)
    if cov["share"] < 1.0:
        raise MigrationError(f"refused: {window['to']['name']} covers {cov['covered']}/{cov['live']} live items "
                             f"({cov['share']:.2%}); rerun `imgest migrate start` to finish the re-encode "
                             f"(missing e.g. {cov['missing_examples'][:3]})")
    state = index_current(store, window["to"]["slug"])
    if not state["current"]:
        raise MigrationError(f"refused: {window['to']['name']} has no current index ({state['reason']}); run "
                             "`imgest migrate start` or the nightly build first")
    aliases = list_aliases(store)
    if gate is not None:
        if reason := check_gate(gate, margin, aliases):
            raise MigrationError(f"refused by the gate file: {reason}")
        window["evaluation"] = evaluation_record(gate, "promote --gate")
    reason = check_evaluation(window.get("evaluation"), margin, aliases)
    if reason and not force:
        raise MigrationError(f"refused: {reason}")
    shadow = None
    if min_shadow_agreement is not None:  # asked for explicitly: --force does not skip it
        shadow = shadow_summary(store, window["id"])
        if refusal := check_agreement(shadow, min_shadow_agreement):
            raise MigrationError(f"refused: {refusal}")
    card = _latest_card(store, window["to"]["slug"])
    open_index(store, card["slug"], card["version"])  # checksums verified before anything points at it
    why = f"migration {window['id']} promote" + (f" (forced: {force})" if force else
                                                 f" (evaluated on {window['evaluation'].get('query_file')})")
    serving = read_alias(store, "serving")
    if serving is not None:
        set_alias(store, "previous", read_card(store, serving["slug"], serving["version"]), why, fence)
    set_alias(store, "serving", card, why, fence)
    window["status"] = "promoted"
    proof = {"forced": force, "unproven": reason} if force else {"evaluation": window["evaluation"]}
    if shadow is not None:
        proof["shadow"] = {"min_agreement": min_shadow_agreement, "queries": shadow["queries"],
                           "mean_overlap": shadow["mean_overlap"]}
    recorded = record(store, window, "promoted", fence, serving=f"{card['slug']} v{card['version']}",
                      margin=margin, **proof)
    _announce("imgest.migration.promoted", store, window, card["slug"], forced=force)
    return recorded


def rollback(store: Location, fence: Fence | None = None) -> dict:
    """serving -> the old model's newest verified index, at any time before finish."""
    window = require_window(store)
    card = _latest_card(store, window["from"]["slug"])
    open_index(store, card["slug"], card["version"])
    set_alias(store, "serving", card, f"migration {window['id']} rollback", fence)
    window["status"] = "rolled_back"
    recorded = record(store, window, "rolled_back", fence, serving=f"{card['slug']} v{card['version']}")
    _announce("imgest.migration.rolled-back", store, window, card["slug"])
    return recorded


def finish(store: Location, retain_days: float = 7.0, fence: Fence | None = None,
           now: datetime | None = None) -> dict:
    """Close the window; the model not serving is scheduled for deletion after the retention, counted from
    `now` (the wall clock when None; tests pass a time)."""
    now = now or datetime.now(UTC)
    if read_window(store) is None and (closed := last_closed(store)) is not None:
        # run again after a finish that closed the window (killed before it returned, or simply twice): the
        # window is finished; what is left is deleting what its retention allows, which this resumes
        _check(store, fence)
        return {"window": closed, "deleted": collect_retired(store, fence, now), "already_finished": True}
    window = require_window(store)
    _check(store, fence)
    serving = read_alias(store, "serving")
    keep = serving["slug"] if serving else window["to"]["slug"]
    drop = window["from"] if keep == window["to"]["slug"] else window["to"]
    retire_at = (now + timedelta(days=retain_days)).isoformat(timespec="seconds")
    window["status"], window["closed_at"], window["retired"] = "finished", now_iso(), drop
    # the commit: a writer that lost the lock (even one paused after its check) stops here having changed nothing
    record(store, window, "finished", fence, keep=keep, retire=drop["slug"], retire_after=retire_at)
    for name in ("previous", "shadow"):  # window-only aliases: rollback is no longer possible after finish
        delete_alias(store, name, fence)
    store.write_json(layout.retired_key(drop['slug']), {**drop, "retire_after": retire_at,
                                                               "window": window["id"]})
    store.write_json(layout.closed_window_key(window['id']), window)
    fenced_delete(store, WINDOW_KEY, _stored_version(store, window, fence), fence)
    _announce("imgest.migration.finished", store, window, drop["slug"], retire_after=retire_at)
    return {"window": window, "deleted": collect_retired(store, fence, now)}


def last_closed(store: Location) -> dict | None:
    """The window closed last (migration/history/), or None."""
    closed = [store.read_json(layout.file_in(layout.CLOSED_WINDOWS, name))
              for name in store.list_names(layout.CLOSED_WINDOWS) if name.endswith(".json")]
    closed = [w for w in closed if isinstance(w, dict) and w.get("status") == "finished"]
    return max(closed, key=lambda w: str(w.get("closed_at", "")), default=None)


def _announce(event: str, store: Location, window: dict, slug: str, **details) -> None:
    emit(event, store.url, slug, {"window": window["id"], "from": window["from"]["model_id"],
                                  "to": window["to"]["model_id"], **details})


def nightly_models(store: Location, model: str | None = None) -> tuple[list[tuple[str, str | None]], list[str]]:
    """What tonight ingests and indexes: (model name, expected slug) pairs, and the names left out.

    While a window is open, its two models (changes and deletions must reach both); otherwise every model
    an alias points at, `serving` first, so a finished migration needs no edit of any deployment. A model
    named explicitly is added to those; a retired one never is. A store with neither: DEFAULT_MODEL.
    """
    from imgest import encoders
    from imgest.names import DEFAULT_MODEL

    window = read_window(store)
    if window is not None:
        pairs = [(encoders.recorded(window[side]["name"], store, f"{store.url}: {WINDOW_KEY}: {side}"),
                  window[side]["slug"]) for side in ("from", "to")]
    else:
        pairs = []
        for _, alias in sorted(list_aliases(store).items(), key=lambda kv: (kv[0] != "serving", kv[0])):
            # a model named by a record: only one this installation has, never a URL or a hub download
            record = read_model(store, alias["slug"]) if alias["slug"] not in {s for _, s in pairs} else None
            if record is not None:
                pairs.append((record["name"], alias["slug"]))
    left_out = []
    if model:
        slug = encoders.resolve(model).slug
        if slug in retired_slugs(store):
            left_out.append(f"{model} (model={slug}) was retired by a finished migration window: not ingested")
        elif slug not in {s for _, s in pairs}:
            pairs.append((model, None))
    if not pairs and not left_out:
        pairs = [(DEFAULT_MODEL, None)]
    return pairs, left_out


def check_window_model(expected_slug: str | None, spec: EncoderSpec) -> None:
    """A window's model resolves to the slug the window recorded (its weights unchanged): checked before a
    night ingests anything."""
    if expected_slug is not None and spec.slug != expected_slug:
        raise MigrationError(f"the weights behind {spec.model_id.split('@')[0]} changed during the migration "
                             f"window (now model={spec.slug}, window has model={expected_slug}); restore them "
                             "or roll back and finish the window")
