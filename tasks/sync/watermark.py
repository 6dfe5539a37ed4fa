"""What a store remembers of each sync target, below `sync/<target-slug>/`:

  locks/writer/...         the target's writer lock (imgest/state/lock.py): one sync or switch of a target at a time
  <model-slug>/            what one model's collection in the target holds:
    <seq>.intent.parquet   the item ids a sync is about to upsert, written before the target is touched
    <seq>.manifest.parquet every item the target holds after that sync (item_id, content_hash, meta_hash)
    <seq>.json             the watermark, created (never replaced) once the target acknowledged every batch

The last watermark names the committed state the target reflects. A sync killed before its watermark left an
intent: the next one treats the intent's ids as possibly in the target (deleted there if no longer live), and
upserts are keyed by item_id, so a rerun converges with nothing missing, duplicated or left deleted.
"""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from imgest.state.layout import sync_target_prefix
from imgest.state.lock import Fence
from imgest.storage import Location, records
from imgest.storage.cache import local_copy

_NAME = re.compile(r"^(\d{8})(\.json|\.intent\.parquet|\.manifest\.parquet)$")
MANIFEST_SCHEMA = pa.schema([("item_id", pa.string()), ("content_hash", pa.string()), ("meta_hash", pa.string())])


class WatermarkError(RuntimeError):
    """The watermark could not be created (another sync wrote that sequence number): nothing recorded."""


def target_dir(target_slug: str) -> str:
    return sync_target_prefix(target_slug)


def model_dir(target_slug: str, model_slug: str) -> str:
    """The records of one model's collection in a target, as the `target_slug` the functions below take."""
    return f"{target_slug}/{model_slug}"


def synced_models(store: Location, target_slug: str) -> list[str]:
    """Slugs of the models with a watermark in this target."""
    return [name for name in store.list_names(target_dir(target_slug))
            if records.SLUG.match(name) and listing(store, model_dir(target_slug, name))["json"]]


def _key(target_slug: str, seq: int, suffix: str) -> str:
    return f"{target_dir(target_slug)}/{seq:08d}{suffix}"


def listing(store: Location, target_slug: str) -> dict[str, list[int]]:
    """Sequence numbers by kind: watermarks (`json`), `intent`s and `manifest`s, each ascending."""
    found: dict[str, list[int]] = {"json": [], "intent": [], "manifest": []}
    for name in store.list_names(target_dir(target_slug)):
        if m := _NAME.match(name):
            found[m.group(2).split(".")[1]].append(int(m.group(1)))
    return {kind: sorted(seqs) for kind, seqs in found.items()}


def last_watermark(store: Location, target_slug: str) -> dict | None:
    seqs = listing(store, target_slug)["json"]
    if not seqs:
        return None
    key = _key(target_slug, seqs[-1], ".json")
    mark = store.read_json(key)
    where = f"{store.url}: {key}"
    records.field(mark, "seq", int, where)
    records.field(mark, "model_id", str, where)
    records.field(mark, "manifest", str, where)
    return mark


def manifest_file(store: Location, target_slug: str, mark: dict | None, folder: str) -> str | None:
    """The items the last synced target holds, as a Parquet file on local disk (downloaded into `folder` from
    an object store), its columns checked; None before the first sync."""
    if mark is None:
        return None
    key = store.resolve(mark["manifest"], "manifest")
    if not key.startswith(target_dir(target_slug) + "/"):
        raise records.RecordError(f"{store.url}: the watermark of {target_slug} names a manifest outside its folder")
    path = local_copy(store, key, folder, checksum="", suffix=".parquet")
    try:
        names = set(pq.read_schema(path).names)
    except (OSError, pa.ArrowInvalid) as exc:
        raise records.RecordError(f"{store.url}: {key} is not a Parquet manifest: {exc}") from exc
    if not set(MANIFEST_SCHEMA.names) <= names:
        raise records.RecordError(f"{store.url}: {key} lacks the manifest's columns {', '.join(MANIFEST_SCHEMA.names)}")
    return path


def unfinished_ids(store: Location, target_slug: str, after: int) -> pa.Array:
    """Item ids that syncs killed after watermark `after` may have written to the target (each once)."""
    parts = [store.read_table(_key(target_slug, seq, ".intent.parquet"))["item_id"].combine_chunks().cast(pa.string())
             for seq in listing(store, target_slug)["intent"] if seq > after]
    return pc.unique(pa.concat_arrays(parts)) if parts else pa.array([], pa.string())


def next_seq(store: Location, target_slug: str) -> int:
    return max((s for seqs in listing(store, target_slug).values() for s in seqs), default=0) + 1


def write_intent(store: Location, target_slug: str, seq: int, upserts: str) -> None:
    """`upserts`: a local Parquet file with the item_id of every row the sync is about to send."""
    store.put_file(_key(target_slug, seq, ".intent.parquet"), upserts)


def commit(store: Location, target_slug: str, seq: int, manifest: str, mark: dict, fence: Fence) -> dict:
    """Record a finished sync: its manifest (a local Parquet file, MANIFEST_SCHEMA), then (fenced, create-only)
    its watermark; older records go."""
    manifest_key = _key(target_slug, seq, ".manifest.parquet")
    store.put_file(manifest_key, manifest)
    mark = {**mark, "seq": seq, "manifest": manifest_key}
    fence.check()  # the target's lock, in its own folder
    if store.write_json_if(_key(target_slug, seq, ".json"), mark, None) is None:
        raise WatermarkError(f"{store.url}: {_key(target_slug, seq, '.json')} exists: another sync of this target "
                             "recorded the same sequence; run the sync again")
    for kind, seqs in listing(store, target_slug).items():  # the watermarks stay, as the target's history
        for old in seqs:
            if kind != "json" and old < seq or kind == "intent" and old == seq:
                store.delete(_key(target_slug, old, f".{kind}.parquet"))
    return mark
