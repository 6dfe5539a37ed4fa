"""A supervised head at catalogue size reads the labelled items, not the catalogue: the label file is read as
columns and joined with the live set in the state's database, the labelled vectors are read shard by shard, and the
eval queries' negatives are drawn by shard. The mechanism at 200,000 items: what Python and numpy allocate
(tracemalloc; DuckDB's and Arrow's own buffers are neither) stays under a cap that loading the live set the way
train-head did (`load_live_vectors`: every id, uri and hash as a Python string) exceeds several times over."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from imgest import encoders
from imgest.state.layout import shard_key, snapshot_key
from imgest.state.live import load_live_sample, load_live_vectors
from imgest.state.rows import STATE_SCHEMA
from imgest.state.shards import shard_schema
from imgest.storage import Location
from imgest.tasks.heads.evaluate import query_gallery
from imgest.tasks.heads.files import labelled_set
from tests.helpers import traced

SPEC = encoders.resolve("raw-pixels-2")  # d = 12

N, SHARD, LABELLED, NEGATIVES = 200_000, 2_000, 4_000, 3_000
CAP = 8 << 20  # the labelled rows' vectors (200 KB), one shard's vectors at a time, a shard list: nothing per item
RUN = "r00000001-20261205T000000-aaaaaa"


def write_store(folder) -> tuple[Location, np.ndarray, np.ndarray, np.ndarray]:
    """N items written straight as shards (ids shuffled across them, as a listing's order puts them; each shard
    recording torch fp32) and one full snapshot saying every item is live. Returns the store, the ids, vectors and
    shard numbers (row r of each: the item numbered r)."""
    rng = np.random.default_rng(0)
    ids = np.char.add("catalogue/sku-", np.char.zfill(np.arange(N).astype(str), 7)).astype(object)
    vectors = rng.normal(size=(N, SPEC.dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    placed = rng.permutation(N)
    schema = shard_schema(SPEC).with_metadata({**shard_schema(SPEC).metadata, b"imgest.runtime": b"torch",
                                                b"imgest.precision": b"fp32"})
    shard_of = np.empty(N, object)
    for number, begin in enumerate(range(0, N, SHARD)):
        rows, name = placed[begin:begin + SHARD], f"part-{RUN}-{number:05d}"
        shard_of[rows] = name
        n = len(rows)
        table = pa.table({"item_id": pa.array(ids[rows], pa.string()), "uri": pc.binary_join_element_wise(
            "s3://shop/", pa.array(ids[rows], pa.string()), ""), "content_hash": pa.array(ids[rows], pa.string()),
            "model_id": pa.array([SPEC.model_id] * n), "embedding": pa.FixedSizeListArray.from_arrays(
                pa.array(vectors[rows].ravel()), SPEC.dim), "etag": pa.array(["e"] * n), "size": pa.array([1] * n),
            "mtime": pa.array([0.0] * n), "run_id": pa.array([RUN] * n),
            "encoded_at": pa.array([0] * n, pa.timestamp("us", tz="UTC"))}, schema=schema)
        path = folder / shard_key(SPEC.slug, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)
    item_ids = pa.array(ids, pa.string())
    snapshot = folder / snapshot_key(SPEC.slug, 1)
    snapshot.parent.mkdir(parents=True)
    pq.write_table(pa.table({
        "item_id": item_ids, "uri": pc.binary_join_element_wise("s3://shop/", item_ids, ""),
        "status": pa.array(["live"] * N), "etag": pa.array(["e"] * N), "size": pa.array(np.ones(N, np.int64)),
        "mtime": pa.array(np.zeros(N)), "content_hash": item_ids, "shard": pa.array(shard_of, pa.string()),
        "run_id": pa.array([RUN] * N), "reason": pa.nulls(N, pa.string()), "updated_at": pa.array(["t"] * N)},
        schema=STATE_SCHEMA), snapshot)
    return Location(str(folder)), ids, vectors, np.argsort(placed) // SHARD


def test_a_supervised_head_reads_its_labelled_items_and_negatives_by_shard_not_the_live_set(tmp_path):
    store, ids, vectors, shard_number = write_store(tmp_path / "store")
    base = {"slug": SPEC.slug, "dim": SPEC.dim, "model_id": SPEC.model_id, "name": SPEC.name}
    rng = np.random.default_rng(1)
    labelled = np.sort(rng.choice(N, LABELLED, replace=False))
    lines = ["item_id,label"] + [f"{ids[r]},p{r % 500}" for r in labelled] + ["not/in/store.jpg,p0"]
    (tmp_path / "labels.csv").write_text("\n".join(lines) + "\n")
    named = rng.choice(np.setdiff1d(np.arange(N), labelled), 5, replace=False)  # relevant, but unlabelled
    (tmp_path / "queries.jsonl").write_text(json.dumps({"query_id": "q", "image": "q.png",
                                                        "relevant": [ids[r] for r in named]}) + "\n")

    data, peak = traced(lambda: labelled_set(store, base, str(tmp_path / "labels.csv")))
    assert peak < CAP, f"reading the labelled set traced {peak / 1e6:.1f} MB"
    assert data.item_ids.to_pylist() == [ids[r] for r in labelled], "the labelled live items, in item_id order"
    assert data.labels.to_pylist() == [f"p{r % 500}" for r in labelled]
    np.testing.assert_array_equal(data.vectors, vectors[labelled])
    assert data.counts == {"labelled_live_items": LABELLED, "unlabelled_live_items": N - LABELLED,
                           "labels_not_in_store": 1, "labelled_items_read": LABELLED}
    assert data.encoded_by == {"torch fp32": LABELLED}, "what encoded them, as their shards record it"

    # --max-items: a seeded sample of the labelled live items, drawn in the join; the counts still of them all
    sample, peak = traced(lambda: labelled_set(store, base, str(tmp_path / "labels.csv"), max_items=1_000, seed=3))
    assert peak < CAP, f"sampling the labelled set traced {peak / 1e6:.1f} MB"
    picked = sample.item_ids.to_pylist()
    assert len(picked) == 1_000 and picked == sorted(picked) and set(picked) <= {ids[r] for r in labelled}
    row_of = {item: r for r, item in enumerate(ids)}
    np.testing.assert_array_equal(sample.vectors, vectors[[row_of[i] for i in picked]])
    assert sample.counts == {**data.counts, "labelled_items_read": 1_000}
    assert labelled_set(store, base, str(tmp_path / "labels.csv"), max_items=1_000, seed=3).item_ids == \
        sample.item_ids, "the same seed draws the same items"
    assert labelled_set(store, base, str(tmp_path / "labels.csv"), max_items=1_000, seed=4).item_ids != \
        sample.item_ids

    ids_of, _ = data.originals()
    gallery, peak = traced(lambda: query_gallery(store, base, str(tmp_path / "queries.jsonl"), ids_of, data.vectors,
                                                 NEGATIVES, seed=0))
    assert peak < CAP, f"drawing the negatives traced {peak / 1e6:.1f} MB"
    searched = gallery.item_ids.to_pylist()
    assert len(searched) == len(set(searched)) == LABELLED + 5 + NEGATIVES and gallery.negatives == NEGATIVES
    assert searched[LABELLED:LABELLED + 5] == sorted(ids[r] for r in named), "the items the queries name"
    drawn = np.array([row_of[i] for i in searched[LABELLED + 5:]])
    assert not np.isin(drawn, labelled).any() and not np.isin(drawn, named).any()
    np.testing.assert_array_equal(gallery.vectors[LABELLED + 5:], vectors[drawn])
    assert len(set(shard_number[drawn])) <= 2 * NEGATIVES // SHARD + 1, "a few shards drawn, rows within them"
    assert gallery.live == N

    sample, peak = traced(lambda: load_live_sample(store, SPEC.slug, SPEC.dim, 2_000, seed=0))
    assert len(sample) == 2_000 and peak < CAP, f"a label-free head's sample traced {peak / 1e6:.1f} MB"

    everything, peak = traced(lambda: load_live_vectors(store, SPEC.slug, SPEC.dim))
    assert len(everything) == N and peak > 4 * CAP, f"the live set traced {peak / 1e6:.1f} MB"
