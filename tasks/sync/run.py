"""One sync of a target: the model's live items against what the target last acknowledged, the difference
upserted and deleted in batches into the model's own collection, the watermark recorded, then the target's name
pointed at it when the model is the store's serving one."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from prefect import task
from prefect.cache_policies import NO_CACHE

from imgest.config import SyncConfig
from imgest.lock import StoreLock, StoreLockedError
from imgest.progress import report
from imgest.storage import Location, RecordError, open_location
from imgest.tasks.ingest.metadata import load_metadata
from imgest.tasks.ingest.shards import embedding_matrix
from imgest.tasks.state.committed import LIVE, load_state, now_iso, shard_key
from imgest.tasks.state.live import live_by_shard, live_fingerprint
from imgest.tasks.state.models import find_model
from imgest.tasks.sync import watermark
from imgest.tasks.sync.targets import Model, SyncError, Target, TargetSpec, open_target, parse_target

log = logging.getLogger("imgest")
_RESERVED = ("item_id", "vector")


@dataclass(frozen=True)
class Plan:
    """What one sync sends: ids to upsert (new or changed content or metadata) and to delete."""

    upsert: pa.Array  # item ids, sorted
    delete: pa.Array  # item ids, sorted
    manifest: pa.Table  # every live item after the sync (watermark.MANIFEST_SCHEMA)


def resolve_model(store: Location, alias: str | None, model: str | None) -> dict:
    """The model card of --model, or of the model --alias points at."""
    if model:
        return find_model(store, model)
    from imgest.tasks.migration.aliases import read_alias

    target = read_alias(store, alias or "serving")
    if target is None:
        raise SyncError(f"store {store.url} has no alias {alias or 'serving'!r}: name one with --alias or a model "
                        "with --model")
    return find_model(store, target["slug"])


def live_manifest(state, metadata: pa.Table | None) -> pa.Table:
    """(item_id, content_hash, meta_hash) of every live item; meta_hash: its metadata row's hash, if any."""
    live = state.query(f"SELECT item_id, content_hash FROM state WHERE status = '{LIVE}' ORDER BY item_id")
    ids = live["item_id"].combine_chunks()
    if metadata is None:
        hashes = pa.nulls(len(ids), pa.string())
    else:
        hashes = metadata["row_hash"].cast(pa.string()).take(pc.index_in(ids, value_set=metadata["item_id"]))
    return pa.table({"item_id": ids, "content_hash": live["content_hash"].cast(pa.string()), "meta_hash": hashes},
                    schema=watermark.MANIFEST_SCHEMA)


def plan(now: pa.Table, before: pa.Table, maybe_there: pa.Array) -> Plan:
    """Upsert what is new or whose content or metadata changed; delete what was (or may have been) sent and
    is no longer live. Columnar: a join, no object per item."""
    old = before.append_column("sent", pa.array([True] * before.num_rows, pa.bool_()))
    joined = now.join(old, "item_id", join_type="left outer", right_suffix="_sent")

    def same(name: str) -> pa.ChunkedArray:  # equal, a null equal to a null
        a, b = joined[name], joined[f"{name}_sent"]
        return pc.or_(pc.and_(pc.is_null(a), pc.is_null(b)), pc.fill_null(pc.equal(a, b), False))

    unchanged = pc.and_(pc.fill_null(joined["sent"], False), pc.and_(same("content_hash"), same("meta_hash")))
    changed = joined.filter(pc.invert(unchanged))["item_id"].combine_chunks()
    upsert = changed.take(pc.array_sort_indices(changed))
    gone = pa.concat_arrays([before["item_id"].combine_chunks().cast(pa.string()), maybe_there.cast(pa.string())])
    gone = pc.unique(gone.filter(pc.invert(pc.is_in(gone, value_set=now["item_id"]))))
    return Plan(upsert, gone.take(pc.array_sort_indices(gone)), now)


def metadata_columns(metadata: pa.Table | None) -> pa.Schema:
    """The metadata's columns as the target carries them (a name the target uses itself gets `metadata_`)."""
    if metadata is None:
        return pa.schema([])
    return pa.schema([pa.field(f"metadata_{f.name}" if f.name in _RESERVED else f.name, f.type)
                      for f in metadata.schema if f.name not in ("item_id", "row_hash")])


def live_shards(state, item_ids: pa.Array) -> pa.Table:
    """(item_id, shard) of these live items."""
    live = state.query(f"SELECT item_id, shard FROM state WHERE status = '{LIVE}'")
    return live.filter(pc.is_in(live["item_id"], value_set=item_ids))


def rows_for(store: Location, slug: str, live: pa.Table, metadata: pa.Table | None, columns: pa.Schema,
             dim: int, batch: int):
    """Batches of (item_id, vector, metadata columns) for the live items `live` (item_id, shard), one shard
    read at a time."""
    pending: list[pa.Table] = []
    size = 0
    # each shard's items found by one grouping of the live rows (a filter of them per shard was N x shards)
    for shard, keep, _ in live_by_shard(live):
        table = store.read_table(shard_key(slug, shard))
        table = table.filter(pc.is_in(table["item_id"], value_set=keep))
        vectors = embedding_matrix(table, dim)
        rows = pa.table({"item_id": table["item_id"].cast(pa.string()),
                         "vector": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel(), pa.float32()), dim)})
        if metadata is not None:
            found = metadata.take(pc.index_in(rows["item_id"], value_set=metadata["item_id"]))
            for field, source in zip(columns, (n for n in metadata.column_names if n not in ("item_id", "row_hash"))):
                rows = rows.append_column(field, found[source])
        pending.append(rows)
        size += rows.num_rows
        while size >= batch:
            whole = pa.concat_tables(pending)
            yield whole.slice(0, batch)
            rest = whole.slice(batch)
            pending, size = ([rest] if rest.num_rows else []), rest.num_rows
    if size:
        yield pa.concat_tables(pending)


def sync(config: SyncConfig) -> dict:
    """Bring the target `config.to` in step with the model's live items; returns what was sent and the
    watermark."""
    spec = parse_target(config.to)  # before anything is opened: a URL with credentials goes no further
    batch = config.batch
    store = open_location(config.store, must_exist=True, what="store")
    card = resolve_model(store, config.alias, config.model)
    wanted = Model(card["model_id"], card["slug"], int(card["dim"]))
    folder = Location(store.uri(watermark.target_dir(spec.slug)))
    owner = f"imgest sync to {spec.url} (pid {os.getpid()} on {socket.gethostname()})"
    lock = StoreLock(folder, owner)
    try:
        fence = lock.acquire()
    except StoreLockedError as exc:
        raise StoreLockedError(f"target {spec.url}: another sync of it is running; wait for it to finish ({exc})") \
            from None
    try:
        return _sync_locked(store, spec, card, wanted, batch, fence)
    finally:
        lock.release()


def serving_slug(store: Location) -> str | None:
    from imgest.tasks.migration.aliases import read_alias

    serving = read_alias(store, "serving")
    return serving["slug"] if serving else None


def _sync_locked(store: Location, spec: TargetSpec, card: dict, wanted: Model, batch: int, fence) -> dict:
    if watermark.listing(store, spec.slug)["json"]:
        raise SyncError(f"--to {spec.url}: synced by an earlier imgest into {spec.name} itself (watermarks in "
                        f"{store.url}/{watermark.target_dir(spec.slug)}); drop {spec.name} in the target and that "
                        "folder in the store, and the next sync rebuilds it with a collection per model")
    fingerprint = live_fingerprint(store, card["slug"])
    state = load_state(store, card["slug"])
    metadata = load_metadata(store)
    columns = metadata_columns(metadata)
    folder = watermark.model_dir(spec.slug, wanted.slug)
    mark = watermark.last_watermark(store, folder)
    if mark is not None and mark["model_id"] != wanted.model_id:
        raise SyncError(f"--to {spec.url}: the target was synced from model {mark['model_id']}, not "
                        f"{wanted.model_id}; sync another collection")
    # the name follows the store's serving alias; in a store with none yet (a first `sync --model`), the first
    # model synced takes it
    serving = serving_slug(store)
    target: Target = open_target(spec)
    try:
        takes_name = wanted.slug == serving or serving is None and target.answers() is None
        created = target.open(wanted, columns, takes_name)
        before = watermark.read_manifest(store, folder, None if created else mark)
        maybe = pa.array([], pa.string()) if created else \
            watermark.unfinished_ids(store, folder, mark["seq"] if mark else 0)
        todo = plan(live_manifest(state, metadata), before, maybe)
        seq = watermark.next_seq(store, folder)
        fence.check()
        watermark.write_intent(store, folder, seq, todo.upsert)
        total, done = len(todo.upsert) + len(todo.delete), 0
        what = f"sync {spec.engine}:{spec.name}"
        for start in range(0, len(todo.delete), batch):
            ids = todo.delete.slice(start, batch).to_pylist()
            target.delete(ids)
            done += len(ids)
            report(what, done, total, "items")
        sending = live_shards(state, todo.upsert)
        state.close()  # its database's memory goes before the rows are read and sent
        for rows in rows_for(store, wanted.slug, sending, metadata, columns, wanted.dim, batch):
            target.upsert(rows)
            done += rows.num_rows
            report(what, done, total, "items")
        record = {"target": spec.url, "engine": spec.engine, "collection": target.collection,
                  "model_id": wanted.model_id, "slug": wanted.slug, "state_seq": state.seq,
                  "pending_commits": list(state.pending), "live_fingerprint": fingerprint,
                  "live": todo.manifest.num_rows, "upserted": len(todo.upsert), "deleted": len(todo.delete),
                  "created": now_iso(), "created_collection": created}
        mark = watermark.commit(store, folder, seq, todo.manifest, record, fence)
        if takes_name:
            fence.check()
            target.point(wanted)
        answers = target.answers()
        dropped = drop_retired(store, spec, target, fence)
    finally:
        target.close()
    return {"target": spec.url, "model": wanted.model_id, "collection": record["collection"],
            "answers": answers == wanted.model_id, "dropped": dropped, "upserted": len(todo.upsert),
            "deleted": len(todo.delete),
            "live": todo.manifest.num_rows,
            "watermark": {"seq": mark["seq"], "key": f"{watermark.target_dir(folder)}/{mark['seq']:08d}.json",
                          "state_seq": state.seq, "live_fingerprint": fingerprint}}



def drop_retired(store: Location, spec: TargetSpec, target: Target, fence) -> list[str]:
    """The collections of models a finished window retired, dropped with their records once the store deleted
    the models' data (after the window's retention, never while an alias needs them)."""
    from imgest.tasks.migration.retention import retired_slugs, retirement

    gone = []
    for slug in sorted(set(watermark.synced_models(store, spec.slug)) & retired_slugs(store)):
        try:
            entry = retirement(store, f"{slug}.json")
        except (RecordError, ValueError) as exc:  # malformed: nothing dropped, left for a person to look at
            log.warning("sync to %s: kept the collection of model=%s: %s", spec.url, slug, exc)
            continue
        if not entry.get("deleted_at"):
            continue
        fence.check()
        target.drop(Model(str(entry.get("model_id", "")), slug, 0))
        store.delete_tree(watermark.target_dir(watermark.model_dir(spec.slug, slug)))
        gone.append(slug)
    return gone


def sync_or_record(config: SyncConfig) -> dict:
    """A sync as one step of a larger run (the nightly): a target that fails is that target's failure, recorded
    in one line with the store untouched (no watermark), and the run goes on; the next sync catches up."""
    from imgest.redact import one_line, redact

    try:
        return sync(config)
    except Exception as exc:  # a target down or refusing: that target's, never the night's
        log.error("sync to %s failed: %s", redact(config.to), redact(one_line(exc)))
        return {"target": redact(config.to), "error": redact(one_line(exc))}


@task(name="sync", cache_policy=NO_CACHE)
def sync_task(config: SyncConfig) -> dict:
    return sync_or_record(config)
