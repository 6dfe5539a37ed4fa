"""One sync of a target: the model's live items against what the target last acknowledged, the difference
upserted and deleted in batches into the model's own collection, the watermark recorded, then the target's name
pointed at it when the model is the store's serving one."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from prefect import task
from prefect.cache_policies import NO_CACHE

from imgest.config import SyncConfig
from imgest.progress import report
from imgest.scratch import scratch_folder
from imgest.state.clock import now_iso
from imgest.state.committed import LIVE, load_state
from imgest.state.layout import shard_key
from imgest.state.live import LIVE_BATCH, METADATA_BATCH, live_fingerprint, shard_groups
from imgest.state.lock import StoreLock, StoreLockedError
from imgest.state.metadata import snapshot_file, write_merged
from imgest.state.models import find_model
from imgest.state.rows import SORT_MEMORY, one_thread, scratch_sql, sql_string
from imgest.state.shards import embedding_matrix
from imgest.storage import Location, RecordError, open_location
from imgest.tasks.sync import watermark
from imgest.tasks.sync.targets import (
    Model,
    SyncError,
    Target,
    TargetError,
    TargetSpec,
    open_target,
    parse_target,
    target_failed,
)

log = logging.getLogger("imgest")
_RESERVED = ("item_id", "vector")


@dataclass(frozen=True)
class Plan:
    """What one sync sends, as files on local disk beside the state (no object per item): `now`, every live item
    after the sync (MANIFEST_SCHEMA, the manifest the watermark records); `upsert`, the (item_id, shard, the
    metadata's columns: null for none) to send (new, or changed content or metadata), in shard order; `delete`,
    the ids to delete."""

    now: str
    upsert: str
    upserts: int
    delete: pa.Array
    live: int


def resolve_model(store: Location, alias: str | None, model: str | None) -> dict:
    """The model card of --model, or of the model --alias points at."""
    if model:
        return find_model(store, model)
    from imgest.state.aliases import read_alias

    target = read_alias(store, alias or "serving")
    if target is None:
        raise SyncError(f"store {store.url} has no alias {alias or 'serving'!r}: name one with --alias or a model "
                        "with --model")
    return find_model(store, target["slug"])


def plan(state, metadata: str | None, before: str | None, maybe_there: pa.Array) -> Plan:
    """Upsert what is new or whose content or metadata changed; delete what was (or may have been) sent and is
    no longer live. The live rows, in item_id order, are merged with `metadata` (the snapshot's local Parquet
    file, sorted by item_id; None: the store holds none) for each row's metadata hash, compared with the previous
    manifest's file in the state's DuckDB (memory capped, spilling), and the rows to upsert merged with the
    snapshot again for their metadata columns, then sorted by shard: read a shard at a time by `rows_for`."""
    folder = state.base.folder
    live, now, upsert, manifest, narrow, wide = (os.path.join(folder, f"sync-{name}.parquet")
                                                 for name in ("live", "now", "upsert", "manifest", "narrow", "wide"))
    names = [n for n in pq.read_schema(metadata).names if n not in ("item_id", "row_hash")] if metadata else []
    sent = f"read_parquet({sql_string(before)})" if before else \
        "(SELECT NULL::VARCHAR AS item_id, NULL::VARCHAR AS content_hash, NULL::VARCHAR AS meta_hash WHERE false)"
    with state.sql() as cur:
        cur.execute(f"""COPY (SELECT item_id, content_hash, shard{"" if metadata else ", NULL::VARCHAR AS row_hash"}
                              FROM state WHERE status = '{LIVE}' ORDER BY item_id) TO {sql_string(live)}
                        (FORMAT parquet, ROW_GROUP_SIZE {METADATA_BATCH})""")
    if metadata:  # each live row's metadata hash (its snapshot row's)
        write_merged(metadata, live, ["item_id", "content_hash", "shard"], ["row_hash"], now, METADATA_BATCH)
        os.remove(live)
    else:
        os.replace(live, now)
    with state.sql() as cur:
        cur.register("maybe", pa.table({"item_id": maybe_there.cast(pa.string())}))
        cur.execute(f"""CREATE TEMP VIEW now AS SELECT item_id, content_hash, shard, row_hash AS meta_hash
                        FROM read_parquet({sql_string(now)})""")
        cur.execute(f"""CREATE TEMP VIEW sent AS SELECT CAST(item_id AS VARCHAR) AS item_id,
                        CAST(content_hash AS VARCHAR) AS content_hash, CAST(meta_hash AS VARCHAR) AS meta_hash
                        FROM {sent}""")
        cur.execute(f"""COPY (SELECT n.item_id, n.shard FROM now n LEFT JOIN sent b ON b.item_id = n.item_id
                              WHERE b.item_id IS NULL OR b.content_hash IS DISTINCT FROM n.content_hash
                                 OR b.meta_hash IS DISTINCT FROM n.meta_hash
                              ORDER BY n.{"item_id" if metadata else "shard, n.item_id"})
                        TO {sql_string(narrow if metadata else upsert)}
                        (FORMAT parquet, ROW_GROUP_SIZE {LIVE_BATCH})""")
        delete = cur.sql("""SELECT DISTINCT g.item_id FROM (SELECT item_id FROM sent UNION ALL
                                                              SELECT item_id FROM maybe) g
                            WHERE NOT EXISTS (SELECT 1 FROM now n WHERE n.item_id = g.item_id)
                            ORDER BY g.item_id""").to_arrow_table()["item_id"].combine_chunks()
        cur.execute(f"COPY (SELECT item_id, content_hash, meta_hash FROM now) TO {sql_string(manifest)} "
                    "(FORMAT parquet)")
        cur.execute("DROP VIEW now")
        cur.execute("DROP VIEW sent")
    os.remove(now)
    if metadata:  # the rows to send with their metadata columns (the snapshot's row whose hash the plan read),
        # merged, then sorted by shard apart: on one thread, the rows as wide as the metadata
        write_merged(metadata, narrow, ["item_id", "shard"], names, wide, METADATA_BATCH)
        os.remove(narrow)
        with scratch_sql(folder) as con, one_thread(con, SORT_MEMORY):
            con.execute(f"""COPY (SELECT * FROM read_parquet({sql_string(wide)}) ORDER BY shard, item_id)
                            TO {sql_string(upsert)} (FORMAT parquet, ROW_GROUP_SIZE {METADATA_BATCH})""")
        os.remove(wide)
    upserts = pq.read_metadata(upsert).num_rows
    return Plan(manifest, upsert, upserts, delete, pq.read_metadata(manifest).num_rows)


def metadata_columns(metadata: str | None) -> pa.Schema:
    """The metadata's columns (of the snapshot file `metadata`) as the target carries them (a name the target
    uses itself gets `metadata_`)."""
    if metadata is None:
        return pa.schema([])
    return pa.schema([pa.field(f"metadata_{f.name}" if f.name in _RESERVED else f.name, f.type)
                      for f in pq.read_schema(metadata) if f.name not in ("item_id", "row_hash")])


def rows_for(store: Location, slug: str, upsert: str, columns: pa.Schema, dim: int, batch: int):
    """Batches of (item_id, vector, metadata columns) for the items of `upsert` (a Parquet file of item_id, shard
    and the metadata's columns, in shard order), one shard read at a time; an item's metadata is its row of the
    shard's group, looked up among the shard's ids only."""
    pending: list[pa.Table] = []
    size = 0
    for group in shard_groups(upsert, METADATA_BATCH if len(columns) else LIVE_BATCH):
        shard, keep = group["shard"][0].as_py(), group["item_id"].combine_chunks()
        table = store.read_table(shard_key(slug, shard))
        table = table.filter(pc.is_in(table["item_id"], value_set=keep))
        vectors = embedding_matrix(table, dim)
        rows = pa.table({"item_id": table["item_id"].cast(pa.string()),
                         "vector": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel(), pa.float32()), dim)})
        if len(columns):  # the shard's rows in the group's order: their metadata, carried by the plan
            found = group.take(pc.index_in(rows["item_id"], value_set=keep))
            for field, source in zip(columns, group.column_names[2:]):
                rows = rows.append_column(field, found[source].cast(field.type))
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
    from imgest.state.aliases import read_alias

    serving = read_alias(store, "serving")
    return serving["slug"] if serving else None


def _sync_locked(store: Location, spec: TargetSpec, card: dict, wanted: Model, batch: int, fence) -> dict:
    if watermark.listing(store, spec.slug)["json"]:
        raise SyncError(f"--to {spec.url}: synced by an earlier imgest into {spec.name} itself (watermarks in "
                        f"{store.url}/{watermark.target_dir(spec.slug)}); drop {spec.name} in the target and that "
                        "folder in the store, and the next sync rebuilds it with a collection per model")
    fingerprint = live_fingerprint(store, card["slug"])
    state = load_state(store, card["slug"])
    metadata = snapshot_file(store, scratch_folder(state, "sync"))
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
        before = watermark.manifest_file(store, folder, None if created else mark, state.base.folder)
        maybe = pa.array([], pa.string()) if created else \
            watermark.unfinished_ids(store, folder, mark["seq"] if mark else 0)
        todo = plan(state, metadata, before, maybe)
        state.close()  # its database's memory goes before the rows are read and sent (its folder stays)
        seq = watermark.next_seq(store, folder)
        fence.check()
        watermark.write_intent(store, folder, seq, todo.upsert)
        total, done = todo.upserts + len(todo.delete), 0
        what = f"sync {spec.engine}:{spec.name}"
        batches, n = -(-len(todo.delete) // batch) + -(-todo.upserts // batch), 0
        for start in range(0, len(todo.delete), batch):
            ids = todo.delete.slice(start, batch).to_pylist()
            n += 1
            with _batch(spec, f"batch {n} of {batches} (deleting items {start + 1:,}-{start + len(ids):,} of "
                              f"{len(todo.delete):,})"):
                target.delete(ids)
            done += len(ids)
            report(what, done, total, "items")
        upserts = _Counted(rows_for(store, wanted.slug, todo.upsert, columns, wanted.dim, batch),
                           todo.upserts, lambda rows: report(what, done + rows, total, "items"))
        with _batch(spec, lambda: f"batch {n + upserts.n} of {batches} (upserting items {upserts.at})", upserts):
            target.upsert(upserts)
        record = {"target": spec.url, "engine": spec.engine, "collection": target.collection,
                  "model_id": wanted.model_id, "slug": wanted.slug, "state_seq": state.seq,
                  "pending_commits": list(state.pending), "live_fingerprint": fingerprint,
                  "live": todo.live, "upserted": todo.upserts, "deleted": len(todo.delete),
                  "created": now_iso(), "created_collection": created}
        mark = watermark.commit(store, folder, seq, todo.now, record, fence)
        if takes_name:
            fence.check()
            target.point(wanted)
        answers = target.answers()
        dropped = drop_retired(store, spec, target, fence)
    finally:
        target.close()
    return {"target": spec.url, "model": wanted.model_id, "collection": record["collection"],
            "answers": answers == wanted.model_id, "dropped": dropped, "upserted": todo.upserts,
            "deleted": len(todo.delete),
            "live": todo.live,
            "watermark": {"seq": mark["seq"], "key": f"{watermark.target_dir(folder)}/{mark['seq']:08d}.json",
                          "state_seq": state.seq, "live_fingerprint": fingerprint}}


class _Counted:
    """The upsert batches as the target takes them: the batch in hand (`n`, `at`) for a failure's line,
    progress reported once a batch has been taken and the next is asked for, and a failure to read them from
    the store (`error`) kept apart from the target's."""

    def __init__(self, batches: Iterator[pa.Table], total: int, progress: Callable[[int], None]):
        self.batches, self.total, self.progress = batches, total, progress
        self.n, self.sent, self.at, self.error = 0, 0, "none yet", None

    def __iter__(self) -> Iterator[pa.Table]:
        while True:
            try:
                rows = next(self.batches, None)
            except Exception as exc:  # the store's, raised to the engine's client reading the batches
                self.error = exc
                raise
            if rows is None:
                return
            self.n += 1
            self.at = f"{self.sent + 1:,}-{self.sent + rows.num_rows:,} of {self.total:,}"
            yield rows
            self.sent += rows.num_rows
            self.progress(self.sent)


@contextmanager
def _batch(spec: TargetSpec, step: str | Callable[[], str], source: _Counted | None = None):
    """A batch the target refuses (or fails to take): one line naming the target, the batch (`step`, or what
    `step()` says when it failed) and what the engine said; the sync stops there, before its watermark. The
    batches failing to be read from the store (`source.error`) is the store's failure, raised as itself."""
    try:
        yield
    except (SyncError, TargetError):
        raise
    except Exception as exc:  # whatever the engine's client raises: its own classes, gRPC's, HTTP's, OSError
        if source is not None and source.error is not None:
            raise source.error from None
        raise target_failed(spec, step() if callable(step) else step, exc) from exc


def drop_retired(store: Location, spec: TargetSpec, target: Target, fence) -> list[str]:
    """The collections of models a finished window retired, dropped with their records once the store deleted
    the models' data (after the window's retention, never while an alias needs them)."""
    from imgest.state.retention import retired_slugs, retirement

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
        said = redact(exc.reason) if isinstance(exc, TargetError) else one_line(exc)
        log.error("sync to %s failed: %s", redact(config.to), said)
        return {"target": redact(config.to), "error": said}


@task(name="sync", cache_policy=NO_CACHE)
def sync_task(config: SyncConfig) -> dict:
    return sync_or_record(config)
