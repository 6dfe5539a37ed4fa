"""An IVF version carried forward in place: the same index and the same exact lists as a fresh build on the
same training, only the change read, and a retrain when the training no longer fits."""

import os

import numpy as np
import pyarrow as pa
import pytest

from imgest.config import IndexConfig
from imgest.flows.build_index import build_index
from imgest.retrieval.versions import IdMapFile, open_index
from imgest.state.live import load_live_vectors
from imgest.storage import Location
from imgest.tasks.index.build import new_index
from imgest.tasks.index.truth import carry_truth, exact_truth
from imgest.tasks.index.update import Delta, apply_delta
from tests.helpers import gradient, ingest_into, png_bytes, write_files


def clustered(n: int, d: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(32, d))
    x = (centres[rng.integers(0, 32, n)] + 0.4 * rng.normal(size=(n, d))).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def churn(n: int, seed: int = 1):
    """Old rows 0..n-1; 3% leave; 4% arrive. New catalogue order: survivors then arrivals, shuffled together."""
    rng = np.random.default_rng(seed)
    keep = np.sort(rng.choice(n, size=n - 3 * n // 100, replace=False))
    arrivals = 4 * n // 100
    new_order = rng.permutation(len(keep) + arrivals)  # new faiss id of each (survivor..., arrival...)
    remap = np.full(n, -1, np.int64)
    remap[keep] = new_order[:len(keep)]
    return keep, remap, new_order[len(keep):]


def test_carried_lists_equal_a_fresh_exact_search_for_every_usable_query():
    old = clustered(3000, 32, 0)
    truth = exact_truth(old, np.arange(0, 3000, 15), depth=30)
    keep, remap, added_ids = churn(3000)
    added = clustered(120, 32, 7)
    new = np.empty((len(keep) + len(added), 32), np.float32)
    new[remap[keep]], new[added_ids] = old[keep], added

    carried = carry_truth(truth, remap, added_ids, added)
    usable = carried.usable(10)
    assert usable.mean() > 0.9, "3% churn leaves nearly every 30-deep list with an exact top 10"
    for row in np.flatnonzero(usable):
        scores = new @ carried.queries[row]
        if carried.query_ids[row] >= 0:
            scores[carried.query_ids[row]] = -np.inf  # the query's own item is never its neighbour
        order = np.argsort(-scores)[:10]
        np.testing.assert_allclose(carried.scores[row, :10], scores[order], rtol=1e-5, atol=1e-5)
        kth = scores[order[-1]]
        assert all(scores[i] >= kth - 1e-5 for i in carried.ids[row, :10]), "ties aside, the same neighbours"
    gone = truth.query_ids[remap[truth.query_ids] < 0]
    assert len(gone) and (carried.query_ids[np.isin(truth.query_ids, gone)] == -1).all(), \
        "a probe whose item left keeps its vector and excludes nothing"


def test_carrying_the_lists_over_many_added_vectors_keeps_a_block_at_a_time(monkeypatch):
    """The added vectors are scored against the probes in blocks, each keeping its best depth + 1 per probe
    (a night adding 1% of 100M would otherwise hold 1,000 x 1M scores and ids): the same lists and floors as
    scoring them all at once."""
    from imgest.tasks.index import truth as truth_module

    old = clustered(3000, 32, 0)
    truth = exact_truth(old, np.arange(0, 3000, 15), depth=30)
    keep, remap, added_ids = churn(3000)
    added = clustered(120, 32, 7)
    whole = carry_truth(truth, remap, added_ids, added)
    monkeypatch.setattr(truth_module, "CARRY_BLOCK", 7)
    blocks = carry_truth(truth, remap, added_ids, added)
    np.testing.assert_array_equal(blocks.scores, whole.scores)
    np.testing.assert_array_equal(blocks.floor, whole.floor)
    assert (blocks.usable(10) == whole.usable(10)).all()
    exact = np.isfinite(whole.scores)
    assert (blocks.ids[exact] == whole.ids[exact]).mean() > 0.99, "the same neighbours, ties aside"


@pytest.mark.parametrize("factory", ["IVF32,SQ8", "IVF32,PQ8,Refine(SQfp16)", "OPQ8_32,IVF32,PQ8,Refine(SQfp16)"])
def test_an_updated_ivf_index_searches_like_one_filled_afresh_with_the_same_training(factory):
    """IVF lists renumbered in place; a re-ranking index's float16 vectors follow the new numbering."""
    import faiss

    old = clustered(4000, 32, 0)
    trained = new_index(32, factory)  # as imgest trains them: polysemous training off, OPQ bounded
    trained.train(old)
    first = faiss.clone_index(trained)
    first.add(old)
    keep, remap, added_ids = churn(4000)
    added = clustered(160, 32, 9)
    new = np.empty((len(keep) + len(added), 32), np.float32)
    new[remap[keep]], new[added_ids] = old[keep], added

    updated = apply_delta(first, Delta(ids=IdMapFile(len(new)), remap=remap, added_ids=added_ids, added=added))
    fresh = faiss.clone_index(trained)
    fresh.add(new)
    for index in (updated, fresh):
        faiss.extract_index_ivf(index).nprobe = 4
        if "Refine" in factory:
            faiss.downcast_index(index).k_factor = 4
    assert updated.ntotal == fresh.ntotal == len(new)
    (du, iu), (df, if_) = updated.search(new[::50], 10), fresh.search(new[::50], 10)
    np.testing.assert_allclose(du, df, rtol=1e-5, atol=1e-5)
    for a, b, dist in zip(iu, if_, df):
        same = dist[:-1] != dist[1:]  # beyond ties, the very same ids in the same order
        assert (a[:-1][same] == b[:-1][same]).all()


@pytest.mark.parametrize("factory", ["IVF32,PQ8,Refine(SQfp16)", "OPQ8_32,IVF32,PQ8,Refine(SQfp16)"])
def test_re_rank_vectors_on_disk_are_renumbered_into_a_new_file_equal_to_the_update_in_ram(
        factory, tmp_path, monkeypatch):
    """Re-rank vectors served from disk stay mapped through an update: the new file is written a block of rows
    at a time (3 rows here), and is byte for byte the file of the same update done in RAM."""
    import faiss

    from imgest.retrieval.mapped import open_mapped
    from imgest.tasks.index import rerank

    monkeypatch.setattr(rerank, "BLOCK", 3)
    old = clustered(2000, 32, 0)
    first = new_index(32, factory)
    first.train(old)
    first.add(old)
    path = str(tmp_path / "v1.faiss")
    faiss.write_index(first, path)
    keep, remap, added_ids = churn(2000)
    added = clustered(80, 32, 9)

    def delta():
        return Delta(ids=IdMapFile(len(keep) + len(added)), remap=remap, added_ids=added_ids, added=added)

    in_ram = apply_delta(faiss.read_index(path), delta())
    mapped = open_mapped(path)
    assert rerank.on_disk(faiss.downcast_index(mapped))
    on_disk = apply_delta(mapped, delta())
    assert on_disk is not mapped and rerank.on_disk(faiss.downcast_index(on_disk)), "a new file, still mapped"
    assert faiss.serialize_index(on_disk).tobytes() == faiss.serialize_index(in_ram).tobytes()


def test_a_build_writes_re_rank_vectors_to_disk_as_faiss_writes_them_from_ram(tmp_path, monkeypatch):
    import faiss

    from imgest.tasks.index import rerank

    monkeypatch.setattr(rerank, "BLOCK", 7)
    x = clustered(1500, 32, 3)
    trained = new_index(32, "IVF16,PQ8,Refine(SQfp16)")
    trained.train(x)
    in_ram = faiss.clone_index(trained)
    in_ram.add(x)
    refine = faiss.downcast_index(trained)
    refine.base_index.add(x)
    mapped = rerank.write_mapped(refine, len(x), rerank.encoded_blocks(refine, x), str(tmp_path))
    assert rerank.on_disk(faiss.downcast_index(mapped)) and not os.listdir(tmp_path), "mapped, file unlinked"
    assert faiss.serialize_index(mapped).tobytes() == faiss.serialize_index(in_ram).tobytes()
    with pytest.raises(rerank.RerankError, match="written for 1500 rows"):
        rerank.write_mapped(refine, len(x), rerank.encoded_blocks(refine, x[:-1]), str(tmp_path))
    assert not os.listdir(tmp_path)


def _catalogue(root, names: range, seed_shift: int = 0):
    write_files(str(root), {f"p/{i:04d}.png": png_bytes(gradient(i + seed_shift, (16, 16))) for i in names})


@pytest.mark.usefixtures("prefect_harness")
def test_nightly_change_updates_the_ivf_version_in_place_then_retrains_past_the_share(tmp_path):
    cat, store = tmp_path / "catalogue", tmp_path / "store"
    _catalogue(cat, range(400))
    common = {"store": str(store), "model": "raw-pixels", "kind": "IVF8,SQ8", "queries": 200, "alias": None,
              "target_recall": 0.9}
    ingest_into(cat, store, model="raw-pixels", batch_size="64", shard_size=100)
    v1 = build_index(IndexConfig(**common))["card"]
    assert v1["lineage"]["method"] == "build" and v1["lineage"]["trained_in"] == 1 and v1["truth_file"]

    for i in range(5):
        (cat / "p" / f"{i:04d}.png").unlink()
    _catalogue(cat, range(10, 13), seed_shift=1000)  # changed content
    _catalogue(cat, range(400, 410))  # new
    summary = ingest_into(cat, store, model="raw-pixels", batch_size="64")
    assert summary["deleted"] == 5 and summary["encoded"] == 13
    v2 = build_index(IndexConfig(**common))["card"]
    line = v2["lineage"]
    assert line["method"] == "update" and line["updated_from"] == 1 and line["trained_in"] == 1
    assert (line["added"], line["removed"], v2["n"]) == (13, 8, 405)
    assert v2["recall"]["met"] and v2["recall"]["queries"] >= 0.8 * 200 and v2["times"]["train_seconds"] == 0

    loc = Location(str(store))
    updated = open_index(loc, v2["slug"], 2)
    live = load_live_vectors(loc, v2["slug"], v2["d"])
    assert updated.item_ids.to_pylist() == live.item_ids, \
        "faiss id = position in item_id order, as a fresh build numbers them"
    import faiss

    faiss.extract_index_ivf(updated.index).nprobe = 8  # every list
    _, ids = updated.search(live.vectors, 1)
    assert (ids[:, 0] == np.arange(len(live))).mean() > 0.99, "every vector, new and changed ones too, finds itself"

    fresh = build_index(IndexConfig(**common, rebuild=True))["card"]
    assert fresh["lineage"]["method"] == "build" and "--rebuild" in fresh["lineage"]["why"]

    _catalogue(cat, range(410, 520))  # 110 new: over 20% of the 405 that v3 was trained on
    ingest_into(cat, store, model="raw-pixels", batch_size="64")
    v4 = build_index(IndexConfig(**common))["card"]
    assert v4["lineage"]["method"] == "build" and "retrain share" in v4["lineage"]["why"] and v4["n"] == 515


@pytest.mark.usefixtures("prefect_harness")
def test_an_update_starts_from_the_version_an_alias_serves(tmp_path):
    from imgest.retrieval.versions import read_card
    from imgest.state.aliases import set_alias

    cat, store = tmp_path / "catalogue", tmp_path / "store"
    _catalogue(cat, range(200))
    ingest_into(cat, store, model="raw-pixels", batch_size="64")
    common = {"store": str(store), "model": "raw-pixels", "kind": "IVF4,SQ8", "queries": 100, "alias": None,
              "target_recall": 0.9}
    v1 = build_index(IndexConfig(**common))["card"]
    build_index(IndexConfig(**common, rebuild=True))  # v2, never served
    set_alias(Location(str(store)), "serving", read_card(Location(str(store)), v1["slug"], 1), reason="rolled back")
    _catalogue(cat, range(200, 204))
    ingest_into(cat, store, model="raw-pixels", batch_size="64")
    v3 = build_index(IndexConfig(**common))["card"]
    assert v3["lineage"]["method"] == "update" and v3["lineage"]["updated_from"] == 1 and v3["n"] == 204


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.parametrize("damaged", ["truth_file", "ids_file"])  # its exact lists; its id map, which DuckDB scans
def test_a_damaged_previous_version_is_not_carried_forward_but_trained_anew(tmp_path, damaged):
    cat, store = tmp_path / "catalogue", tmp_path / "store"
    _catalogue(cat, range(120))
    ingest_into(cat, store, model="raw-pixels", batch_size="64")
    common = {"store": str(store), "model": "raw-pixels", "kind": "IVF4,SQ8", "queries": 50, "alias": None}
    v1 = build_index(IndexConfig(**common))["card"]
    rotten = store / v1[damaged]
    rotten.write_bytes(rotten.read_bytes()[:-7] + b"garbage")  # bit rot in one of the old version's files
    _catalogue(cat, range(120, 123))
    ingest_into(cat, store, model="raw-pixels", batch_size="64")
    v2 = build_index(IndexConfig(**common))["card"]
    assert v2["lineage"]["method"] == "build" and "v0001 cannot be carried forward" in v2["lineage"]["why"]
    assert v2["n"] == 123 and v2["recall"]["met"]


@pytest.mark.usefixtures("prefect_harness")
def test_hnsw_is_built_again_and_says_why(tmp_path):
    cat, store = tmp_path / "catalogue", tmp_path / "store"
    _catalogue(cat, range(60))
    ingest_into(cat, store, model="raw-pixels", batch_size="64")
    common = {"store": str(store), "model": "raw-pixels", "kind": "hnsw", "queries": 50, "alias": None}
    build_index(IndexConfig(**common))
    _catalogue(cat, range(60, 64))
    ingest_into(cat, store, model="raw-pixels", batch_size="64")
    card = build_index(IndexConfig(**common))["card"]
    assert card["lineage"]["method"] == "build" and "HNSW graph cannot remove" in card["lineage"]["why"]


def _noisy_catalogue(root, names: range):
    from PIL import Image

    rng = np.random.default_rng(names.start)
    pictures = {f"p/{i:04d}.png": Image.fromarray(rng.integers(0, 256, (16, 16, 3)).astype(np.uint8)) for i in names}
    write_files(str(root), {name: png_bytes(picture) for name, picture in pictures.items()})


@pytest.fixture
def small_rule(monkeypatch):
    """The index rule's sizes made small: exact search up to 10 items, HNSW up to 50, IVF past it."""
    from imgest.tasks.index import choice as rule

    monkeypatch.setattr(rule, "FLAT_MAX_N", 10)
    monkeypatch.setattr(rule, "HNSW_NIGHTLY_MAX_N", 50)


def _ingested(tmp_path, write, names: range) -> tuple:
    cat, store = tmp_path / "catalogue", tmp_path / "store"
    write(cat, names)
    ingest_into(cat, store, model="raw-pixels", batch_size="64")
    return cat, store


@pytest.mark.usefixtures("prefect_harness", "small_rule")
def test_past_the_measured_size_the_nightly_keeps_an_ivf_index_and_updates_it(tmp_path):
    """HNSW would fit; past the size the rule's constant says (made small here) auto picks IVF,SQ8 over it, the
    card says why, and the next night updates that version in place instead of building a graph again."""
    cat, store = _ingested(tmp_path, _catalogue, range(200))
    common = {"store": str(store), "model": "raw-pixels", "queries": 50, "alias": None, "target_recall": 0.5}
    first = build_index(IndexConfig(**common))["card"]
    assert first["kind"] == "ivfsq8" and first["choice"]["instead_of"] == "hnsw", first["choice"]["reason"]
    assert "past N=50" in first["choice"]["reason"] and first["recall"]["met"]
    _ingested(tmp_path, _catalogue, range(200, 204))
    card = build_index(IndexConfig(**common))["card"]
    assert card["lineage"]["method"] == "update" and card["factory"] == first["factory"], card["lineage"]["why"]


@pytest.mark.usefixtures("prefect_harness", "small_rule")
def test_an_ivf_index_missing_the_target_falls_back_to_hnsw_and_keeps_it_until_the_catalogue_doubles(tmp_path):
    """Noise images leave IVF,SQ8 short of an exact top 10 where the graph finds it: the build falls back to
    HNSW and says why; the next night builds HNSW straight away (not IVF first, then HNSW again)."""
    cat, store = _ingested(tmp_path, _noisy_catalogue, range(300))
    common = {"store": str(store), "model": "raw-pixels", "queries": 100, "alias": None, "target_recall": 1.0}
    first = build_index(IndexConfig(**common))["card"]
    assert first["kind"] == "hnsw" and first["choice"]["missed_at_n"] == 300, first["choice"]["reason"]
    assert "picked over HNSW32 to be updated in place" in first["choice"]["reason"]
    _ingested(tmp_path, _noisy_catalogue, range(300, 310))
    card = build_index(IndexConfig(**common))["card"]
    assert card["kind"] == "hnsw" and f"v{first['version']:04d} fell back to hnsw" in card["choice"]["reason"]


def _state_rows(keys: list[str], status: str, hashes: list[str], shards: list[str]):
    from imgest.state.rows import STATE_SCHEMA

    n = len(keys)
    return pa.table({"item_id": keys, "uri": [f"s3://shop/{k}" for k in keys], "status": [status] * n,
                     "etag": ["e"] * n, "size": [1] * n, "mtime": [0.0] * n, "content_hash": hashes, "shard": shards,
                     "run_id": ["r"] * n, "reason": pa.nulls(n, pa.string()), "updated_at": ["t"] * n},
                    schema=STATE_SCHEMA)


@pytest.mark.parametrize("previous_order", ["item_id", "written before maps were ordered"])
def test_an_update_scans_the_state_in_place_and_brings_back_the_change_and_an_id_map_file(
        tmp_path, monkeypatch, previous_order):
    """A night's state (a full snapshot and a delta, as load_state finds them) under a DuckDB memory cap about
    the size of its rows (at 10M items the cap is 1 GB against 1.4 GB: BENCHMARKS.md): the full snapshot is
    scanned in place, not copied; the live items sorted by DuckDB are merged with the previous id map a batch at
    a time (six batches here), the new id map written to a file, and only the change and one int64 per previous
    vector come back. The numbers are those of a fresh build. A previous map out of item_id order (a store
    written before maps were numbered in order) is joined instead, with the same answer."""
    import pyarrow.parquet as pq

    from imgest import encoders
    from imgest.state import rows
    from imgest.state.committed import CatalogueState
    from imgest.tasks.index import update
    from imgest.tasks.index.update import plan_delta
    from imgest.tasks.ingest.plan import ShardPlan, WorkItem
    from imgest.tasks.ingest.writer import ShardWriter

    monkeypatch.setattr(rows, "STATE_MEMORY", "128MB")
    n, spec, store = 400_000, encoders.resolve("raw-pixels-2"), Location(str(tmp_path / "store"))
    old_ids = [f"catalogue/products/brand-{i // 4000:05d}/sku-{i:010d}.jpg" for i in range(n)]
    old_hashes = [f"{i:032x}" for i in range(n)]
    full = _state_rows(old_ids, "live", old_hashes, ["part-old"] * n)  # ~130 MB of rows
    pq.write_table(full, tmp_path / "full.parquet")
    previous = full.select(["item_id", "uri", "content_hash"]).add_column(0, "faiss_id", pa.array(np.arange(n)))
    if previous_order != "item_id":
        previous = previous.take(pa.array(np.random.default_rng(0).permutation(n)))
    pq.write_table(previous, tmp_path / "previous-ids.parquet")
    del full
    deleted, changed = set(range(0, n, 997)), set(range(5, n, 1009)) - set(range(0, n, 997))
    fresh = sorted([old_ids[i] for i in changed] + [f"catalogue/new-{i:03d}.jpg" for i in range(40)])
    plan = ShardPlan("r00000002-20261203T000000-aaaaaa", 0, tuple(
        WorkItem(k, f"s3://shop/{k}", 1, 0.0, "e", None) for k in fresh))
    writer = ShardWriter(store, spec, plan)
    vectors = clustered(len(fresh), spec.dim, 3)
    writer.add([(item, "new") for item in plan.items], vectors)
    writer.flush()
    gone = sorted(old_ids[i] for i in deleted)
    delta = pa.concat_tables([_state_rows(fresh, "live", ["new"] * len(fresh), [plan.name] * len(fresh)),
                              _state_rows(gone, "deleted", ["d"] * len(gone), ["part-old"] * len(gone))])
    pq.write_table(delta.sort_by("item_id"), tmp_path / "delta.parquet")
    base = rows.StateBase().load([str(tmp_path / "full.parquet"), str(tmp_path / "delta.parquet")])
    assert os.path.getsize(os.path.join(base.folder, "state.duckdb")) < 8 << 20, "the full snapshot is not copied"

    if previous_order == "item_id":  # merged, never joined
        monkeypatch.setattr(update, "_joined_remap", lambda *_: pytest.fail("an ordered map was joined"))
    got = plan_delta(store, spec.slug, spec.dim, str(tmp_path / "previous-ids.parquet"), CatalogueState(spec.slug,
                                                                                                        base=base))

    keys = sorted(set(old_ids) - set(gone) | set(fresh))
    written = pq.read_table(got.ids.path)
    assert isinstance(got.ids, IdMapFile) and got.ids.rows == len(written) == len(keys)
    assert written["item_id"].to_pylist() == keys and written["faiss_id"].to_pylist() == list(range(len(keys)))
    position = {k: i for i, k in enumerate(keys)}
    expected = [-1 if i in deleted or i in changed else position[k] for i, k in enumerate(old_ids)]
    assert got.remap.tolist() == expected and got.removed == len(deleted | changed)
    assert got.added_ids.tolist() == [position[k] for k in fresh]
    np.testing.assert_allclose(got.added, vectors, atol=1e-6)

