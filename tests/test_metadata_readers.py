"""The readers of the catalogue metadata at catalogue size: the search service's metadata file per index version
(mapped, never loaded), export and sync merged with the snapshot on item_id, a shard at a time. The mechanism at
200,000 items with a wide metadata row: what Arrow allocates while each runs (its pool's peak, in a process of its
own) stays under a cap that the snapshot alone, loaded as a table the way these readers did, exceeds several
times over."""

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from imgest.state.committed import write_model_card
from imgest.state.metadata import snapshot_key
from tests.test_train_head_scale import SPEC, write_store

N, SHARD = 200_000, 2_000
TITLE = 600  # characters of a title: the metadata row is far wider than the item's vector at d = 12
CAP = 32 << 20


def _metadata(store_root, keys: list[str]) -> pa.Table:
    """A snapshot as ingest writes it (sorted by item_id, a row hash), every item but each 10th with a row."""
    keys = sorted(keys)
    kept = [k for i, k in enumerate(keys) if i % 10]
    rng = np.random.default_rng(2)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", np.uint8)
    titles = [bytes(letters[rng.integers(0, len(letters), TITLE)]).decode() for _ in range(len(kept))]
    table = pa.table({"item_id": kept, "brand": [f"brand-{i % 13}" for i in range(len(kept))],
                      "price": np.arange(len(kept), dtype=np.float64) / 10, "title": titles,
                      "row_hash": [f"h{i}" for i in range(len(kept))]})
    path = store_root / snapshot_key(1)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=32_768)
    return table


@pytest.fixture(scope="module")
def wide_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("wide")
    store, ids, _, _ = write_store(root)  # N items in shards of SHARD, written straight as Parquet
    write_model_card(store, SPEC.describe())
    table = _metadata(root, list(ids))
    return root, table.nbytes, {k: i for i, k in enumerate(table["item_id"].to_pylist())}


def _arrow_peak(script: str) -> dict:
    """Run `script` in a process of its own (Arrow's pool counts its peak from the start); its last line's JSON,
    with that peak as `arrow_peak`."""
    # the process ends without its interpreter's shutdown: one in four runs of the snapshot's plain load aborted
    # there ("terminate called without an active exception", an Arrow thread at exit), after its figures
    code = script + "\nimport os as _os, sys as _sys, pyarrow as _pa\nprint(json.dumps({**out, 'arrow_peak': " \
                    "_pa.default_memory_pool().max_memory()}))\n_sys.stdout.flush()\n_os._exit(0)\n"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


@pytest.mark.slow("a subprocess")
def test_the_snapshot_loaded_whole_is_what_the_readers_no_longer_hold(wide_store):
    root, snapshot_bytes, _ = wide_store
    got = _arrow_peak(f"""
import json
from imgest.storage import Location
from imgest.state.metadata import load_metadata
out = {{"rows": load_metadata(Location({str(root)!r})).num_rows}}
""")
    assert got["rows"] == N - N // 10
    assert snapshot_bytes > 3 * CAP and got["arrow_peak"] > 3 * CAP, got  # the way they read it: over the cap


@pytest.mark.slow("a subprocess")
def test_a_served_version_maps_its_items_metadata_and_filters_without_loading_it(wide_store, tmp_path):
    root, _, row_of = wide_store
    got = _arrow_peak(f"""
import json, hashlib
import numpy as np
from imgest.storage import Location
from imgest.state.committed import load_state
from imgest.state.live import LiveShards
from imgest.retrieval.idmap import IdMap, IdMapFile
from imgest.retrieval.item_metadata import FAISS_ID, INTERNAL, VersionMetadata
from imgest.retrieval.filters import matching_items
from imgest.retrieval.query import GroupsAt

store = Location({str(root)!r})
live = LiveShards(load_state(store, {SPEC.slug!r}))
made = IdMapFile().number(live.ordered)
sha = hashlib.sha256(open(made.path, "rb").read()).hexdigest()
ids = IdMap(made.path, sha, {str(tmp_path / "cache")!r})
metadata = VersionMetadata(store, ids, {str(tmp_path / "cache")!r})
again = VersionMetadata(store, ids, {str(tmp_path / "cache")!r})  # made once: opened as it is
rows = metadata.rows(np.array([0, 1, 10, 12345, len(ids) - 1]))
table = metadata.table.append_column("item_id", ids.item_ids)
cheap = matching_items(table, "brand = 'brand-3' AND price < 100", select=FAISS_ID, hidden=tuple(INTERNAL))
cheap = metadata.with_rows(cheap.to_numpy())
groups = GroupsAt(metadata, ids, "brand")
out = {{"rows": rows, "items": ids.items(np.array([0, 1, 10, 12345, len(ids) - 1])),
        "same": again.path == metadata.path,
        "cheap": sorted(ids.items(cheap)), "columns": metadata.columns,
        "group_items": ids.items(np.array([1, 2])), "group": [groups.get(i) for i in ids.items(np.array([1, 2]))]}}
""")
    assert got["arrow_peak"] < CAP, f"serving the metadata held {got['arrow_peak'] / 1e6:.1f} MB of Arrow"
    assert got["same"]
    for item, row in zip(got["items"], got["rows"]):
        if item not in row_of:
            assert row is None  # an item without a metadata row has none
        else:
            assert row["brand"] == f"brand-{row_of[item] % 13}" and row["price"] == row_of[item] / 10
            assert len(row["title"]) == TITLE and set(row) == {"brand", "price", "title"}
    assert got["cheap"] == sorted(k for k, r in row_of.items() if r % 13 == 3 and r / 10 < 100)
    assert got["group"] == [None if i not in row_of else f"brand-{row_of[i] % 13}" for i in got["group_items"]]
    brand = next(c for c in got["columns"] if c["name"] == "brand")
    assert brand == {"name": "brand", "type": "text", "values": sorted(f"brand-{i}" for i in range(13))}
    assert {"name": "price", "type": "number", "min": 0.0, "max": (len(row_of) - 1) / 10} in got["columns"]
    assert {"name": "title", "type": "text", "values": None} in got["columns"]  # free text: no choice


@pytest.mark.slow("a subprocess")
def test_an_export_joins_the_metadata_on_disk_a_shard_at_a_time(wide_store, tmp_path):
    root, _, row_of = wide_store
    out = tmp_path / "export.parquet"
    got = _arrow_peak(f"""
import json
from imgest.state.export import export_live
out = export_live({str(root)!r}, {SPEC.name!r}, {str(out)!r})
""")
    assert got["arrow_peak"] < CAP, f"the export held {got['arrow_peak'] / 1e6:.1f} MB of Arrow"
    table = pq.read_table(out, columns=["item_id", "brand", "price", "title"])
    assert got["rows"] == table.num_rows == N
    sample = table.take(np.random.default_rng(0).choice(N, 500, replace=False)).to_pylist()
    for row in sample:
        at = row_of.get(row["item_id"])
        assert (row["brand"], row["price"]) == ((None, None) if at is None else (f"brand-{at % 13}", at / 10))


@pytest.mark.slow("a subprocess")
def test_a_sync_reads_its_rows_metadata_from_the_plan_a_shard_at_a_time(wide_store, tmp_path):
    root, _, row_of = wide_store
    got = _arrow_peak(f"""
import json
import pyarrow as pa
from imgest.storage import Location
from imgest.state.committed import load_state
from imgest.state.metadata import snapshot_file
from imgest.tasks.sync.run import metadata_columns, plan, rows_for

store = Location({str(root)!r})
state = load_state(store, {SPEC.slug!r})
snapshot = snapshot_file(store, {str(tmp_path / "cache")!r})
todo = plan(state, snapshot, None, pa.array([], pa.string()))
columns = metadata_columns(snapshot)
sent, sample = 0, []
for batch in rows_for(store, {SPEC.slug!r}, todo.upsert, columns, {SPEC.dim}, 5000):
    sent += batch.num_rows
    sample += batch.slice(0, 3).select(["item_id", "brand", "price"]).to_pylist()
out = {{"sent": sent, "upserts": todo.upserts, "sample": sample}}
""")
    assert got["arrow_peak"] < CAP, f"the sync's rows held {got['arrow_peak'] / 1e6:.1f} MB of Arrow"
    assert got["sent"] == got["upserts"] == N
    for row in got["sample"]:
        at = row_of.get(row["item_id"])
        assert (row["brand"], row["price"]) == ((None, None) if at is None else (f"brand-{at % 13}", at / 10))


def test_metadata_files_not_opened_for_a_week_go_when_another_is_made(tmp_path):
    import os
    import time

    from imgest.retrieval.item_metadata import UNUSED_DAYS, _sweep

    (tmp_path / "snapshots").mkdir()
    old, recent, kept = (tmp_path / f"metadata-{n}.arrow" for n in ("old", "recent", "new"))
    copy, unrelated = tmp_path / "snapshots" / "a.parquet", tmp_path / "ids-abc.arrow"
    for path in (old, recent, kept, copy, unrelated):
        path.write_bytes(b"x")
    week_ago = time.time() - (UNUSED_DAYS + 1) * 86400
    for path in (old, copy, unrelated, kept):
        os.utime(path, (week_ago, week_ago))
    _sweep(str(tmp_path), keep=str(kept))
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == \
        ["ids-abc.arrow", "metadata-new.arrow", "metadata-recent.arrow"]


def test_a_damaged_metadata_file_is_made_again(tmp_path):
    import hashlib

    from imgest.retrieval.idmap import IdMap
    from imgest.retrieval.item_metadata import VersionMetadata
    from imgest.storage import Location

    store = Location(str(tmp_path / "store"))
    keys = [f"k/{i:03d}.jpg" for i in range(20)]
    ids = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"faiss_id": pa.array(range(20), pa.int64()), "item_id": keys, "uri": keys,
                             "content_hash": keys, "shard": ["s"] * 20}), ids)
    snapshot = tmp_path / "store" / snapshot_key(1)
    snapshot.parent.mkdir(parents=True)
    pq.write_table(pa.table({"item_id": keys[::2], "brand": ["b"] * 10, "_has_row": ["theirs"] * 10,
                             "row_hash": ["h"] * 10}), snapshot)
    idmap = IdMap(str(ids), hashlib.sha256(ids.read_bytes()).hexdigest(), str(tmp_path / "cache"))
    first = VersionMetadata(store, idmap, str(tmp_path / "cache"))
    assert first.rows(np.array([0, 1])) == [{"brand": "b"}, None]  # a column named as ours is not served
    with open(first.path, "r+b") as fh:
        fh.truncate(100)
    again = VersionMetadata(store, idmap, str(tmp_path / "cache"))
    assert again.path == first.path and again.rows(np.array([2, 3])) == [{"brand": "b"}, None]


def _merge_case(tmp_path, snapshot_order: str):
    """Keys (every third id of 0..299, each once) and a snapshot of every second id, one id twice (a damaged
    snapshot), rows before, between and after the keys' range."""
    rng = np.random.default_rng(5)
    snap_ids = [f"id-{i:04d}" for i in range(0, 320, 2)] + ["id-0042"]
    hashes = [f"h{rng.integers(1000):03d}" for _ in snap_ids]
    hashes[-1] = "a-least"  # the repeat of id-0042 has the least hash: its row is the one kept
    table = pa.table({"item_id": snap_ids, "title": [f"t-{k}-{h}" for k, h in zip(snap_ids, hashes)],
                      "price": np.arange(len(snap_ids), dtype=np.float64), "row_hash": hashes})
    order = pa.compute.sort_indices(table, [("item_id", "ascending")]) if snapshot_order == "item_id" else \
        pa.array(rng.permutation(len(table)))
    snapshot = tmp_path / "snapshot.parquet"
    pq.write_table(table.take(order), snapshot, row_group_size=16)
    keys = tmp_path / "keys.parquet"
    key_ids = [f"id-{i:04d}" for i in range(3, 300, 3)]
    pq.write_table(pa.table({"item_id": key_ids, "shard": [f"s{i % 7}" for i in range(len(key_ids))]}), keys,
                   row_group_size=10)
    expected = {}
    for row in table.to_pylist():
        held = expected.get(row["item_id"])
        if held is None or row["row_hash"] < held["row_hash"]:
            expected[row["item_id"]] = row
    return snapshot, keys, key_ids, expected


@pytest.mark.parametrize("snapshot_order", ["item_id", "written before snapshots were sorted"])
def test_keys_merged_with_a_snapshot_get_their_rows_or_nulls(tmp_path, snapshot_order):
    """The readers' merge on item_id, a few rows of each side at a time: each key gets its snapshot row (the one
    with the least row hash where a damaged snapshot has it twice) or nulls, in the keys' order, with the keys'
    columns kept; a snapshot out of order is sorted first, with the same answer."""
    from imgest.state.metadata import write_merged

    snapshot, keys, key_ids, expected = _merge_case(tmp_path, snapshot_order)
    out = tmp_path / "out.parquet"
    write_merged(str(snapshot), str(keys), ["shard", "item_id"], ["title", "price"], str(out), 8)
    got = pq.read_table(out)
    assert got.column_names == ["shard", "item_id", "title", "price"]
    assert got["item_id"].to_pylist() == key_ids
    assert got["shard"].to_pylist() == [f"s{i % 7}" for i in range(len(key_ids))]
    for row in got.to_pylist():
        want = expected.get(row["item_id"])
        assert (row["title"], row["price"]) == ((None, None) if want is None else (want["title"], want["price"]))
    assert got.filter(pa.compute.equal(got["item_id"], "id-0042"))["title"].to_pylist() == ["t-id-0042-a-least"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys.parquet", "out.parquet", "snapshot.parquet"]


def test_keys_out_of_order_are_refused_not_mismatched(tmp_path):
    from imgest.state.metadata import NotInOrder, write_merged

    snapshot, _, key_ids, _ = _merge_case(tmp_path, "item_id")
    keys = tmp_path / "shuffled.parquet"
    pq.write_table(pa.table({"item_id": key_ids[::-1]}), keys)
    with pytest.raises(NotInOrder):
        write_merged(str(snapshot), str(keys), ["item_id"], ["title"], str(tmp_path / "out.parquet"), 8)


@pytest.mark.parametrize("map_order", ["item_id", "written before maps were ordered"])
def test_a_versions_metadata_file_follows_its_faiss_ids_whatever_its_maps_order(tmp_path, map_order):
    """The service's metadata file: the id map merged with the snapshot, then in faiss id order. A map whose ids
    are out of item_id order (a store written before maps were numbered in it) is sorted first: the same rows."""
    import hashlib

    from imgest.retrieval.idmap import ID_MAP_SCHEMA, IdMap
    from imgest.retrieval.item_metadata import VersionMetadata
    from imgest.storage import Location

    keys = [f"k{i:03d}" for i in range(40)]
    titled = [k for i, k in enumerate(keys) if i % 4]
    snapshot = tmp_path / "store" / snapshot_key(1)
    snapshot.parent.mkdir(parents=True)
    pq.write_table(pa.table({"item_id": titled, "title": [f"title of {k}" for k in titled],
                             "row_hash": [f"h-{k}" for k in titled]}), snapshot, row_group_size=8)
    order = keys if map_order == "item_id" else list(np.random.default_rng(3).permutation(keys))
    path = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"faiss_id": np.arange(40), "item_id": order, "uri": order, "content_hash": order,
                             "shard": ["s"] * 40}, schema=ID_MAP_SCHEMA), path, row_group_size=8)
    ids = IdMap(str(path), hashlib.sha256(path.read_bytes()).hexdigest(), str(tmp_path / "cache"))
    metadata = VersionMetadata(Location(str(tmp_path / "store")), ids, str(tmp_path / "cache"))
    rows = metadata.rows(np.arange(40))
    assert rows == [{"title": f"title of {k}"} if k in titled else None for k in order]
