"""A sync's plan is joined in the state's DuckDB against the previous manifest's file: what comes back is the ids
to delete, and files on local disk for the rest (the rows to send by shard, the new manifest). At 400,000 items,
Arrow's own allocations stay under a cap far below the manifests the plan used to hold as columns."""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from imgest.state.committed import LIVE
from imgest.state.layout import snapshot_key
from imgest.state.rows import STATE_SCHEMA

N = 400_000
KEYS = [f"products/{i % 97:02d}/sku-{i:09d}.jpg" for i in range(N)]
CHILD = """
import json, shutil
import pyarrow as pa
import pyarrow.parquet as pq
from imgest.storage import Location
from imgest.state.committed import load_state
from imgest.tasks.sync.run import plan

state = load_state(Location({store!r}), "m")
metadata = {store!r} + "/metadata.parquet"  # ten items gained metadata
pq.write_table(pa.table({{"item_id": sorted(f"products/{{i % 97:02d}}/sku-{{i:09d}}.jpg" for i in range(10)),
                          "title": ["a title"] * 10, "row_hash": ["m"] * 10}}), metadata)
todo = plan(state, metadata, {before!r}, pa.array(["gone/after-a-killed-sync.jpg"]))
for name in ("now", "upsert"):
    shutil.copy(getattr(todo, name), {store!r} + "/" + name + ".parquet")
print(json.dumps({{"arrow_peak": pa.default_memory_pool().max_memory(), "delete": todo.delete.to_pylist(),
                   "upserts": todo.upserts, "live": todo.live, "now": {store!r} + "/now.parquet",
                   "upsert": {store!r} + "/upsert.parquet"}}))
"""


@pytest.mark.slow("a subprocess")
def test_a_sync_plan_brings_back_only_the_deletions_and_sends_what_changed(tmp_path):
    snapshot = tmp_path / snapshot_key("m", 1)
    snapshot.parent.mkdir(parents=True)
    status = [LIVE if i % 50 else "deleted" for i in range(N)]  # every 50th item deleted since the last sync
    hashes = [f"h{i}" + ("-new" if i % 101 == 0 else "") for i in range(N)]  # every 101st changed content
    pq.write_table(pa.table({
        "item_id": KEYS, "uri": KEYS, "status": status, "etag": ["e"] * N, "size": [1] * N, "mtime": [1.0] * N,
        "content_hash": hashes, "shard": [f"part-{i // 2000:05d}" for i in range(N)], "run_id": ["r"] * N,
        "reason": pa.nulls(N, pa.string()), "updated_at": ["t"] * N}, schema=STATE_SCHEMA), snapshot)
    before = tmp_path / "before.parquet"  # what the target held: every item, with its old content
    pq.write_table(pa.table({"item_id": KEYS, "content_hash": [f"h{i}" for i in range(N)],
                             "meta_hash": pa.nulls(N, pa.string())}), before)
    # the plan in a process of its own: Arrow's memory pool records its peak from the process's start
    child = subprocess.run([sys.executable, "-c", CHILD.format(store=str(tmp_path), before=str(before))],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    got = json.loads(child.stdout.strip().splitlines()[-1])
    assert got["arrow_peak"] < 4 * N, f"Arrow held {got['arrow_peak'] / 1e6:.1f} MB planning the sync"

    deleted = {KEYS[i] for i in range(0, N, 50)}
    changed = {KEYS[i] for i in range(N) if i % 101 == 0 and i % 50} | {KEYS[i] for i in range(1, 10)}
    assert got["delete"] == sorted(deleted | {"gone/after-a-killed-sync.jpg"})
    sent = pq.read_table(got["upsert"])
    assert got["upserts"] == len(sent) == len(changed) and set(sent["item_id"].to_pylist()) == changed
    assert sent["shard"].to_pylist() == sorted(sent["shard"].to_pylist()), "in shard order: one read of each"
    titled = sent.filter(pa.compute.is_valid(sent["title"]))["item_id"].to_pylist()  # metadata carried by the plan
    assert sorted(titled) == sorted(KEYS[i] for i in range(1, 10))
    manifest = pq.read_table(got["now"])
    assert got["live"] == len(manifest) == N - len(deleted)
    assert manifest.column_names == ["item_id", "content_hash", "meta_hash"]


def test_a_manifest_without_its_columns_is_refused_as_a_record(tmp_path):
    """A planted manifest (the watermark names it) is checked before DuckDB reads it: one line, nothing sent."""
    import pytest

    from imgest.storage import Location, RecordError
    from imgest.tasks.sync.watermark import manifest_file, target_dir

    store = Location(str(tmp_path / "store"))
    store.write_table(f"{target_dir('t/m')}/00000001.manifest.parquet", pa.table({"item_id": ["a"]}))
    mark = {"manifest": f"{target_dir('t/m')}/00000001.manifest.parquet"}
    with pytest.raises(RecordError, match="lacks the manifest's columns"):
        manifest_file(store, "t/m", mark, str(tmp_path / "scratch"))
    store.write_bytes(f"{target_dir('t/m')}/00000002.manifest.parquet", b"not parquet")
    with pytest.raises(RecordError, match="not a Parquet manifest"):
        manifest_file(store, "t/m", {"manifest": f"{target_dir('t/m')}/00000002.manifest.parquet"},
                      str(tmp_path / "scratch"))
