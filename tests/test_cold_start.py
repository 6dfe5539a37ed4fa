"""A cold start (a new model's first run over the whole catalogue, as `migrate start` runs it) holds no object
per catalogue item: its plan is a file of shards, a head's base rows are matched in SQL, and its commit folds
the markers' rows into the state's database. Measured with tracemalloc (Python objects and numpy arrays; DuckDB's
and Arrow's own buffers are neither) at 200,000 objects, against a cap one WorkItem or ItemState per object
could not meet (each is several hundred bytes: 200,000 of them are over 50 MB)."""


import pyarrow as pa
import pyarrow.parquet as pq

from imgest.images.listing import LISTING_SCHEMA, Listing
from imgest.state.committed import LIVE, CatalogueState, load_state, write_snapshot
from imgest.state.layout import snapshot_key
from imgest.state.rows import STATE_SCHEMA
from imgest.storage import Location
from imgest.tasks.ingest.plan import PlannedShards, attach_base, plan_ingest
from tests.helpers import traced

N, SHARD = 200_000, 2_000
CAP = 16 << 20  # a shard's WorkItems, a batch of rows, a marker's dicts: nothing in proportion to N
KEYS = [f"products/brand-{i % 13:02d}/sku-{i:08d}.jpg" for i in range(N)]


def listing() -> Listing:
    return Listing("s3://shop", pa.table({
        "key": KEYS, "key_ok": [True] * N, "size": [1000 + i % 7 for i in range(N)], "mtime": [1.0] * N,
        "etag": [f"e{i:x}" for i in range(N)], "storage_class": pa.nulls(N, pa.string())}, schema=LISTING_SCHEMA))


def base_state(tmp_path) -> CatalogueState:
    """The serving model's state: every object live, with the listing's signature, in shards of 2,000."""
    snapshot = tmp_path / "base" / snapshot_key("base-model", 1)
    snapshot.parent.mkdir(parents=True)
    pq.write_table(pa.table({
        "item_id": KEYS, "uri": [f"s3://shop/{k}" for k in KEYS], "status": [LIVE] * N,
        "etag": [f"e{i:x}" for i in range(N)],
        "size": [1000 + i % 7 for i in range(N)], "mtime": [1.0] * N, "content_hash": [f"h{i}" for i in range(N)],
        "shard": [f"part-base-{i // SHARD:05d}" for i in range(N)], "run_id": ["r"] * N,
        "reason": pa.nulls(N, pa.string()), "updated_at": ["t"] * N}, schema=STATE_SCHEMA), snapshot)
    return load_state(Location(str(tmp_path / "base")), "base-model")


def test_a_cold_start_plans_every_object_into_a_file_of_shards_and_matches_the_base_in_sql(tmp_path):
    listed = listing()
    plan_ingest(Listing("s3://shop", listed.table.slice(0, 10)), CatalogueState("warm"), "r00000001-x-y", SHARD)
    plan, peak = traced(lambda: plan_ingest(listed, CatalogueState("new-model"), "r00000001-x-y", SHARD))
    assert isinstance(plan.shards, PlannedShards) and len(plan.shards) == N // SHARD
    assert plan.new == plan.to_read == N and plan.unchanged == 0 and plan.counts().tolist() == [SHARD] * (N // SHARD)
    ordered = sorted(KEYS)
    assert [w.item_id for w in plan.shards[0].items] == ordered[:SHARD]
    assert [w.item_id for w in plan.shards[-1].items] == ordered[-SHARD:], "key order, across every shard"
    assert plan.shards[7].name == "part-r00000001-x-y-00007" and plan.shards[7].items[0].uri.startswith("s3://shop/")
    assert peak < CAP, f"planning traced {peak / 1e6:.1f} MB"

    base = base_state(tmp_path)
    plan, peak = traced(lambda: attach_base(plan, base))
    derived = plan.shards[42].items
    assert all(w.base_shard == f"part-base-{int(w.item_id[-12:-4]) // SHARD:05d}" and
               w.base_hash == f"h{int(w.item_id[-12:-4])}" for w in derived), "each item matched to its own base row"
    assert not plan.any_to_decode()
    assert peak < CAP, f"matching the base traced {peak / 1e6:.1f} MB"


def test_a_cold_start_commit_folds_its_markers_rows_into_the_state_database(tmp_path):
    store = Location(str(tmp_path / "store"))
    state = CatalogueState("new-model")

    def commit():
        for number in range(N // SHARD):
            rows = [{"item_id": k, "uri": f"s3://shop/{k}", "etag": "e", "size": 1, "mtime": 1.0,
                     "content_hash": f"h-{k}"} for k in KEYS[number * SHARD:(number + 1) * SHARD]]
            state.apply_commit({"shard": f"part-r00000001-x-y-{number:05d}", "run_id": "r00000001-x-y",
                                "created": "2026-12-03T00:00:00+00:00", "encoded": rows})
        state.apply_commit({"shard": "part-r00000001-x-y-00000", "run_id": "r00000001-x-y",  # a rerun's marker
                            "created": "2026-12-03T00:00:01+00:00", "encoded": [
                                {"item_id": KEYS[0], "uri": "s3://shop/again", "etag": "e2", "size": 2,
                                 "mtime": 2.0, "content_hash": "h-again"}]})
        return write_snapshot(store, state, "r00000001-x-y", {})

    warm = CatalogueState("new-model")  # the modules a first commit imports are not what is measured
    warm.apply_commit({"shard": "part-r00000001-x-y-00000", "run_id": "r00000001-x-y",
                       "created": "2026-12-03T00:00:00+00:00", "encoded": [
                           {"item_id": KEYS[0], "uri": "s3://shop/w", "etag": "e", "size": 1, "mtime": 1.0,
                            "content_hash": "h"}]})
    write_snapshot(Location(str(tmp_path / "warm")), warm, "r00000001-x-y", {})
    seq, peak = traced(commit)
    assert not state.overlay, "no object per item"
    assert peak < CAP, f"folding the markers traced {peak / 1e6:.1f} MB"
    again = load_state(store, "new-model")
    assert seq == 1 and again.count(LIVE) == N
    assert again.rows([KEYS[0]])[KEYS[0]].content_hash == "h-again", "the later row of an item wins"
    assert again.rows([KEYS[5]])[KEYS[5]].shard == "part-r00000001-x-y-00000"

