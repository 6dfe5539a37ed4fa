"""A full build streamed from the store: the live set numbered on disk, shards read once, the id map written to a
file. Every kind gives faiss id = position in item_id order with the right vector behind it, the probes' exact
lists equal a brute-force search, and a live item missing from its shard is left out without a gap."""

import dataclasses
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from imgest import encoders
from imgest.state.committed import load_state, write_model_card
from imgest.state.layout import snapshot_key
from imgest.state.live import LiveShards
from imgest.state.rows import STATE_SCHEMA
from imgest.storage import Location
from imgest.tasks.index.choice import choose_index
from imgest.tasks.index.rerank import on_disk
from imgest.tasks.index.stream import stream_build
from imgest.tasks.ingest.plan import ShardPlan, WorkItem
from imgest.tasks.ingest.writer import ShardWriter

SPEC = encoders.resolve("raw-pixels-2")  # d = 12


def state_rows(keys: list[str], status: list[str], shards: list[str], hashes: list[str] | None = None) -> pa.Table:
    n = len(keys)
    return pa.table({"item_id": keys, "uri": [f"s3://shop/{k}" for k in keys], "status": status,
                     "etag": ["e"] * n, "size": [1] * n, "mtime": [0.0] * n,
                     "content_hash": hashes or [f"h-{k}" for k in keys], "shard": shards, "run_id": ["r"] * n,
                     "reason": pa.nulls(n, pa.string()), "updated_at": ["t"] * n}, schema=STATE_SCHEMA)


def write_store(folder, n: int, shard_size: int, missing: set[int] = frozenset(), deleted: set[int] = frozenset(),
                seed: int = 0, same_vector: dict[int, int] | None = None, same_bytes: dict[int, int] | None = None):
    """n items in shards of `shard_size` (keys shuffled across shards, as a catalogue's listing order would put
    them); the state says every one is live except `deleted`; the items in `missing` have no row in their shard;
    row r of `same_vector` has row s's vector, of `same_bytes` row s's content hash.
    Returns (store, state, {key: vector})."""
    rng = np.random.default_rng(seed)
    keys = [f"catalogue/brand-{i % 7}/sku-{i:07d}.jpg" for i in rng.permutation(n)]
    centres = rng.normal(size=(16, SPEC.dim))
    vectors = (centres[rng.integers(0, 16, n)] + 0.5 * rng.normal(size=(n, SPEC.dim))).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    for row, source in (same_vector or {}).items():
        vectors[row] = vectors[source]
    hashes = [f"h-{k}" for k in keys]
    for row, source in (same_bytes or {}).items():
        hashes[row] = hashes[source]
    store, shards = Location(str(folder)), []
    for number, begin in enumerate(range(0, n, shard_size)):
        rows = [r for r in range(begin, min(begin + shard_size, n)) if r not in missing]
        plan = ShardPlan("r00000001-20261203T000000-aaaaaa", number, tuple(
            WorkItem(keys[r], f"s3://shop/{keys[r]}", 1, 0.0, "e", None) for r in rows))
        writer = ShardWriter(store, SPEC, plan)
        writer.add([(item, hashes[r]) for item, r in zip(plan.items, rows)], vectors[rows])
        writer.flush()
        shards += [plan.name] * (min(begin + shard_size, n) - begin)
    table = state_rows(keys, ["deleted" if r in deleted else "live" for r in range(n)], shards, hashes)
    write_model_card(store, SPEC.describe())
    snapshot = folder / snapshot_key(SPEC.slug, 1)
    snapshot.parent.mkdir(parents=True)
    pq.write_table(table.sort_by("item_id"), snapshot)
    return store, load_state(store, SPEC.slug), dict(zip(keys, vectors))


@pytest.mark.parametrize("factory, refine", [("IVF16,SQ8", None), ("HNSW16", None), ("Flat", None),
                                             ("IVF16,PQ4,Refine(SQfp16)", None), ("IVF16,PQ4,Refine(SQfp16)", "disk")])
def test_a_streamed_build_numbers_in_item_id_order_and_leaves_out_missing_rows(tmp_path, factory, refine):
    missing, deleted = {3, 250, 251, 1999}, {10, 700}
    store, state, vectors = write_store(tmp_path, 2000, 300, missing, deleted)
    live = LiveShards(state)
    state.close()
    assert len(live) == 2000 - len(deleted)
    keys = list(vectors)
    indexed = sorted(keys[r] for r in range(2000) if r not in missing | deleted)

    choice = dataclasses.replace(choose_index(len(live), SPEC.dim, "1G", factory, "unlimited"), refine=refine)
    got = stream_build(store, SPEC.slug, SPEC.dim, live, choice, queries=50, depth=30)
    if refine == "disk":
        import faiss

        assert on_disk(faiss.downcast_index(got.index)), "the re-rank vectors are mapped from a file, not in RAM"

    ids = pq.read_table(got.ids.path)
    assert ids["item_id"].to_pylist() == indexed, "faiss id = position in item_id order, the missing left out"
    assert ids["faiss_id"].to_pylist() == list(range(len(indexed))), "numbered without a gap"
    assert ids["uri"].to_pylist() == [f"s3://shop/{k}" for k in indexed]
    assert got.index.ntotal == got.ids.rows == len(indexed)

    matrix = np.stack([vectors[k] for k in indexed])
    if factory == "Flat":
        np.testing.assert_allclose(got.index.reconstruct_n(0, len(indexed)), matrix, atol=1e-6)
    if "IVF" in factory:
        import faiss

        faiss.extract_index_ivf(got.index).nprobe = 16
        if "Refine" in factory:
            faiss.downcast_index(got.index).k_factor = 16
    _, found = got.index.search(matrix, 1)
    assert (found[:, 0] == np.arange(len(indexed))).mean() > 0.97, "each vector is found under its own faiss id"

    # the probes' lists against a brute-force search of the indexed vectors (each probe's own row left out)
    truth = got.truth
    exact = matrix[truth.query_ids] @ matrix.T
    exact[np.arange(len(truth.query_ids)), truth.query_ids] = -np.inf
    np.testing.assert_allclose(truth.scores, -np.sort(-exact, axis=1)[:, :truth.depth], atol=1e-5)
    np.testing.assert_allclose(np.take_along_axis(exact, truth.ids, 1), truth.scores, atol=1e-5)


def test_a_streamed_build_holds_no_object_per_item_where_loading_the_live_set_did(tmp_path):
    """The mechanism behind a build's memory at 10M items, at 200,000: what Python and numpy allocate (traced by
    tracemalloc; faiss's and Arrow's own buffers are not Python objects) stays under a fixed cap while the build
    runs (the training sample, one block of vectors: nothing in proportion to N), where loading the live vectors
    with their ids, URIs and hashes as lists (the build before it streamed) takes several times the cap."""
    import tracemalloc

    from imgest.state.live import load_live_vectors

    n = 200_000
    store, state, _ = write_store(tmp_path, n, 2000)
    cap = 24 << 20  # the training sample (65,536 x 12 floats) and its copies, one block

    tracemalloc.start()
    live = LiveShards(state)
    choice = choose_index(len(live), SPEC.dim, "1G", "IVF64,SQ8", "unlimited")
    got = stream_build(store, SPEC.slug, SPEC.dim, live, choice, queries=100, depth=30)
    streamed = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert got.index.ntotal == got.ids.rows == n
    assert streamed < cap, f"the streamed build allocated {streamed / 1e6:.1f} MB of Python objects and arrays"

    tracemalloc.start()
    loaded = load_live_vectors(store, SPEC.slug, SPEC.dim)
    gathered = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(loaded) == n and gathered > 2 * cap, f"{gathered / 1e6:.1f} MB"


def test_a_live_sample_is_the_same_rows_as_the_whole_live_set_at_the_sampled_positions(tmp_path):
    """What a whitening fits on: the seeded sample of rows in item_id order, read from the shards holding them,
    with their ids, uris and hashes; `total` counts every live item. A sample as large as the live set is it."""
    from imgest.state.live import load_live_sample, load_live_vectors, sample_rows

    store, state, _ = write_store(tmp_path, 3000, 250, deleted={5, 6})
    state.close()
    whole = load_live_vectors(store, SPEC.slug, SPEC.dim)
    sample = load_live_sample(store, SPEC.slug, SPEC.dim, 400, seed=7)
    rows = sample_rows(len(whole), 400, 7)
    assert len(sample) == 400 and sample.total == len(whole) == 2998
    assert sample.item_ids == [whole.item_ids[r] for r in rows]
    assert sample.uris == [whole.uris[r] for r in rows]
    assert sample.content_hashes == [whole.content_hashes[r] for r in rows]
    np.testing.assert_array_equal(sample.vectors, whole.vectors[rows])
    everything = load_live_sample(store, SPEC.slug, SPEC.dim, 5000, seed=7)
    assert everything.item_ids == whole.item_ids and everything.total == len(whole)


@pytest.mark.usefixtures("prefect_harness")
def test_a_query_by_item_id_reads_the_shard_its_version_recorded_without_loading_the_state(tmp_path, monkeypatch):
    """The id map records the shard each vector came from: the service finds an item by binary search in the
    memory-mapped map and reads that one shard (no catalogue state, no scan of every item)."""
    import imgest.retrieval.items as items
    from imgest.config import IndexConfig
    from imgest.flows.build_index import build_index
    from imgest.retrieval.query import Query, Searcher

    store, state, vectors = write_store(tmp_path, 3000, 300)
    shards = dict(zip(*state.query("SELECT item_id, shard FROM state").to_pydict().values()))
    state.close()
    card = build_index(IndexConfig(store=str(tmp_path), model=SPEC.name, kind="IVF16,SQ8", queries=50,
                                   target_recall=0.5))["card"]
    written = pq.read_table(tmp_path / card["ids_file"])
    assert dict(zip(written["item_id"].to_pylist(), written["shard"].to_pylist())) == shards

    monkeypatch.setattr(items, "load_state", lambda *a: pytest.fail("the state was loaded"))
    searcher = Searcher(str(tmp_path), model=SPEC.slug)
    key = sorted(vectors)[1234]
    np.testing.assert_allclose(searcher.stored_vector(key), vectors[key], atol=1e-6)
    hits = searcher.search([Query("q", item_id=key)], k=5)[0]
    assert len(hits) == 5 and key not in [h.item_id for h in hits]
    assert searcher.position(key) == 1234 and searcher.position("no/such.jpg") is None


def test_an_id_map_out_of_item_id_order_is_scanned_not_searched_by_halves(tmp_path):
    """The binary search holds only for a map in item_id order, which is checked when the map is converted: a map
    written otherwise (an older build, a hand-made store) still finds every item, by a scan."""
    from imgest.retrieval.idmap import IdMap

    keys = ["b.jpg", "a.jpg", "c.jpg"]
    for name, order in (("ordered", sorted(keys)), ("unordered", keys)):
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"faiss_id": list(range(3)), "item_id": order, "uri": [f"s3://x/{k}" for k in order],
                                 "content_hash": ["h"] * 3}), path)
        ids = IdMap(str(path), name, str(tmp_path / "cache" / "indexes"))  # a first search: no cache folder yet
        assert ids.ordered == (name == "ordered") and ids.shards is None
        assert [ids.position(k) for k in order] == [0, 1, 2] and ids.position("d.jpg") is None
        assert ids.items([2, 0]) == [order[2], order[0]] and ids.uri(1) == f"s3://x/{order[1]}"


@pytest.mark.slow("a subprocess")
def test_a_querys_hits_read_their_own_batches_of_the_id_map_not_the_whole_column(tmp_path):
    """The service names a query's hits from the mapped id map: each row read from its own batch. A take on the
    whole chunked column joins every batch first (at 10M items, 430 MB of Arrow memory and 150 ms a query):
    measured here as the Arrow pool's peak in a process that only opens the map and looks the hits up."""
    import subprocess
    import sys

    from imgest.retrieval.idmap import ID_MAP_BATCH, IdMap

    n = 3 * ID_MAP_BATCH + 123
    keys = [f"catalogue/sku-{i:07d}.jpg" for i in range(n)]
    path = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"faiss_id": np.arange(n), "item_id": keys, "uri": [f"s3://shop/{k}" for k in keys],
                             "content_hash": ["h"] * n}), path)
    ids = IdMap(str(path), "checksum", str(tmp_path))  # converted once to the Arrow file the service maps
    assert ids.item_ids.num_chunks > 3
    rows = [n - 1, 5, ID_MAP_BATCH, 2 * ID_MAP_BATCH + 7, 5, ID_MAP_BATCH - 1]  # across batches, repeats
    assert ids.items(np.array(rows)) == [keys[r] for r in rows]
    assert ids.uris_of(np.array(rows)) == [f"s3://shop/{keys[r]}" for r in rows]
    assert ids.items(np.array([], np.int64)) == []
    script = (f"import numpy as np, pyarrow as pa\nfrom imgest.retrieval.idmap import IdMap\n"
              f"ids = IdMap({str(path)!r}, 'checksum', {str(tmp_path)!r})\n"
              f"ids.items(np.array({rows})); ids.uris_of(np.array({rows}))\n"
              "print(pa.default_memory_pool().max_memory())")
    peak = int(subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout)
    assert peak < 64 * 1024, peak  # the item_id column alone is ~7 MB


def _resident_kb(path: str) -> int:
    """The resident kB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's first line: address range, perms, ..., path
                inside = head[-1] == path
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


def _filesystem(path) -> str:
    """The type of the filesystem `path` is on (/proc/mounts: the longest mount point above it)."""
    best, kind = "", ""
    with open("/proc/mounts") as fh:
        for line in fh:
            point, fs = line.split()[1:3]
            if str(path).startswith(point.rstrip("/") + "/") and len(point) > len(best):
                best, kind = point, fs
    return kind


def test_a_served_id_maps_lookups_keep_only_the_pages_they_read(tmp_path):
    """A service looks up a query's hits and its item ids in the mapped id map: each lookup brings the pages it
    reads, not their neighbours, so the map's resident pages follow the queries, not the catalogue (at 10M items
    the default advice left 2.1 GB of file pages resident after a few hundred queries)."""
    from imgest.retrieval.idmap import IdMap

    n = 200_000
    keys = pa.array([f"catalogue/sku-{i:07d}.jpg" for i in range(n)])
    path = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"faiss_id": np.arange(n), "item_id": keys,
                             "uri": pa.compute.binary_join_element_wise("s3://shop/", keys, ""),
                             "content_hash": pa.nulls(n, pa.string())}), path)
    if _filesystem(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("a file in memory cannot be let go of: its pages are the file")
    ids = IdMap(str(path), "checksum", str(tmp_path))  # the Arrow file the service maps, made once (page cached)
    mapped = str(tmp_path / "ids-checksum.arrow")
    size_kb = os.path.getsize(mapped) // 1024
    rows = np.random.default_rng(0).choice(n, 100, replace=False)
    assert ids.items(rows) == [f"catalogue/sku-{r:07d}.jpg" for r in rows]
    assert ids.uris_of(rows[:10]) == [f"s3://shop/catalogue/sku-{r:07d}.jpg" for r in rows[:10]]
    assert [ids.position(f"catalogue/sku-{r:07d}.jpg") for r in rows[:10]] == list(rows[:10])
    resident = _resident_kb(mapped)
    # ~2 pages per hit read, ~18 per search by halves: a few hundred pages of a ~10 MB file
    assert resident < size_kb // 5, (resident, size_kb)


def test_a_map_on_a_filesystem_that_refuses_the_advice_is_still_served(tmp_path, monkeypatch):
    """Letting the cached pages go is advice: where the filesystem refuses it (read-only, remote), the map is
    opened and searched as before."""
    import errno

    from imgest.retrieval.idmap import IdMap

    keys = [f"k{i:03d}.jpg" for i in range(50)]
    path = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"faiss_id": np.arange(50), "item_id": keys, "uri": [f"s3://x/{k}" for k in keys],
                             "content_hash": ["h"] * 50}), path)

    def refused(_fd):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "fdatasync", refused)
    ids = IdMap(str(path), "checksum", str(tmp_path))
    assert ids.position("k042.jpg") == 42 and ids.items(np.array([7, 3])) == ["k007.jpg", "k003.jpg"]
