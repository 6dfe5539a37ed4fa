"""Scale-out: shard encoding on a real Dask cluster (worker processes) through prefect-dask."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from imgest.config import IndexConfig, IngestConfig
from imgest.flows.ingest import ingest
from tests.helpers import gradient, ingest_into, jpeg_bytes, task_runs_named, write_files

pytestmark = pytest.mark.usefixtures("prefect_harness")


def _shards(store) -> dict[str, tuple[str, np.ndarray]]:
    """item_id -> (shard number within its run, embedding), from the Parquet shards as written."""
    out = {}
    for path in sorted(store.glob("embeddings/model=*/part-*.parquet")):
        table = pq.read_table(path)
        for item_id, emb in zip(table.column("item_id").to_pylist(), table.column("embedding").to_pylist()):
            out[item_id] = (path.stem.rsplit("-", 1)[-1], np.asarray(emb, np.float32))
    return out


def test_dask_cluster_writes_the_same_shards_as_local_one_encode_per_limit_slot(tmp_path):
    from prefect.client.orchestration import get_client

    cat = tmp_path / "catalogue"
    files = {f"p/{i:03d}.jpg": jpeg_bytes(gradient(i, (96, 96))) for i in range(14)}
    files["p/broken.jpg"] = b"\xff\xd8\xff not a jpeg"
    write_files(str(cat), files)
    common = {"catalogue": str(cat), "model": "efficientnet-lite0", "batch_size": "2", "shard_size": 3}

    local = ingest(IngestConfig(store=str(tmp_path / "local"), **common))
    dask = ingest(IngestConfig(store=str(tmp_path / "dask"), runner="dask", workers=2,
                               encode_limit="imgest-test-one-encode", **common))

    assert local["workers"] and len(local["workers"]) == 1
    assert len(dask["workers"]) == 2, "both worker processes encoded shards"
    assert dask["parameters"]["runner"] == "dask"
    for key in ("listed", "new", "encoded", "rejected", "shards"):
        assert dask[key] == local[key], key
    assert dask["rejected_items"] == local["rejected_items"]
    a, b = _shards(tmp_path / "local"), _shards(tmp_path / "dask")
    assert a.keys() == b.keys() and len(a) == 14
    for item_id in a:
        assert a[item_id][0] == b[item_id][0], f"{item_id} in the same shard"
        np.testing.assert_allclose(a[item_id][1], b[item_id][1], atol=2e-5)

    # The global concurrency limit exists with one slot, and no two encodes held it at once.
    timeline = pq.read_table(tmp_path / "dask" / "runs" / f"{dask['run_id']}.shards.parquet").to_pylist()
    spans = sorted((row["started"], row["finished"]) for row in timeline)
    assert len(spans) == dask["shards"] == 5
    assert all(prev[1] <= nxt[0] for prev, nxt in zip(spans, spans[1:])), spans
    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name("imgest-test-one-encode")
        assert limit.limit == 1 and limit.active_slots == 0
    runs = task_runs_named("encode-part-" + dask["run_id"], 5)
    assert len(runs) == 5 and all(r.state.is_completed() for r in runs), "task runs reported to this server"


def test_index_trained_once_added_in_parallel_parts_and_merged_equals_one_build(tmp_path, monkeypatch):
    import faiss

    from imgest.flows.build_index import build_index
    from imgest.retrieval.versions import open_index
    from imgest.state.live import load_live_vectors
    from imgest.storage import Location
    from tests.helpers import png_bytes

    cat, store = tmp_path / "catalogue", tmp_path / "store"
    write_files(str(cat), {f"p/{i:04d}.png": png_bytes(gradient(i, (16, 16))) for i in range(600)})
    ingest_into(cat, store, model="raw-pixels", batch_size="64", shard_size=200)

    common = {"store": str(store), "model": "raw-pixels", "kind": "IVF16,SQ8", "queries": 100, "alias": None}
    one = build_index(IndexConfig(**common))["card"]

    def gather_everything(*args, **kwargs):
        raise AssertionError("a build in parts must not load every live vector on the flow's node")

    monkeypatch.setattr("imgest.tasks.index.stream.stream_build", gather_everything)
    parts = build_index(IndexConfig(**common, parts=3, runner="dask", workers=2, rebuild=True))["card"]
    assert "each part read its own shards" in parts["build"]["method"]
    assert one["build"]["parts"] == 1 and parts["build"]["parts"] == 3 and parts["build"]["runner"] == "dask"
    assert parts["n"] == one["n"] == 600 and parts["search"] == one["search"]

    a, b = (open_index(Location(str(store)), c["slug"], c["version"]) for c in (one, parts))
    assert a.item_ids.equals(b.item_ids), "the same faiss id -> item map"
    queries = load_live_vectors(Location(str(store)), one["slug"], one["d"]).vectors[::40]
    for nprobe in (1, 4, 16):
        for opened in (a, b):
            faiss.extract_index_ivf(opened.index).nprobe = nprobe
        (da, ia), (db, ib) = a.search(queries, 20), b.search(queries, 20)
        np.testing.assert_array_equal(ia, ib)
        np.testing.assert_array_equal(da, db)


def test_the_same_flow_runs_on_an_existing_cluster_by_address(tmp_path):
    from distributed import LocalCluster

    from imgest.runners import _api_url

    cat = tmp_path / "catalogue"
    write_files(str(cat), {f"p/{i:03d}.jpg": jpeg_bytes(gradient(i, (64, 64))) for i in range(6)})
    # A cluster the flow did not start, reached by its scheduler address (as dask-kubernetes would be); its
    # workers are configured like any remote worker: with the Prefect API to report to.
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                      env={"PREFECT_API_URL": _api_url()}) as cluster:
        run = ingest_into(cat, tmp_path / "store", model="efficientnet-lite0", batch_size="2", shard_size=2,
                          runner=cluster.scheduler_address)
        worker_pids = {w.pid for w in cluster.workers.values() if hasattr(w, "pid")}
    assert run["encoded"] == 6 and run["shards"] == 3
    assert {int(w.rsplit(":", 1)[1]) for w in run["workers"]} <= worker_pids, "encoded by that cluster's workers"
    names = {r.name for r in task_runs_named("encode-part-" + run["run_id"], 3)}
    assert len(names) == 3
