"""The catalogue state on the store: deltas and full snapshots, read back whole, queried on disk; a killed
process or a failed upload never counts an item twice nor publishes half a snapshot."""

from __future__ import annotations

import dataclasses
import os
from datetime import UTC, datetime, timedelta

import pyarrow.parquet as pq
import pytest

from imgest.state.committed import DELETED, LIVE, CatalogueState, ItemState, load_state
from imgest.state.layout import commit_key
from imgest.storage import Location


def test_a_small_change_is_written_as_a_delta_and_read_back_whole(tmp_path):
    """Nights of small change write only the changed rows; the state read back equals the whole state kept
    by hand, across deltas and the full snapshot that compacts them."""
    from imgest.state.clock import now_iso
    from imgest.state.committed import list_snapshots, write_snapshot

    store = Location(str(tmp_path))
    model = {f"k{i:04d}": ItemState(f"k{i:04d}", f"u{i}", LIVE, f"e{i}", 1, 1.0, f"h{i}", "part-r00000001-a-b-00000",
                                    "r00000001-a-b", None, "2026-11-01T00:00:00+00:00") for i in range(1000)}
    write_snapshot(store, CatalogueState("m", dict(model)), "r00000001-a-b", {})
    for night, changed in [(2, 10), (3, 10), (4, 10), (5, 200)]:
        run = f"r{night:08d}-a-b"
        marker = {"shard": f"part-{run}-00000", "run_id": run, "created": now_iso(),
                  "encoded": [{"item_id": f"k{night * 10 + i:04d}", "uri": "u", "etag": f"n{night}", "size": 2,
                               "mtime": 2.0, "content_hash": f"new{night}"} for i in range(changed)]}
        gone = [f"k{999 - night:04d}"]
        state = load_state(store, "m")
        state.apply_commit(marker)
        state.delete(gone, run, marker["created"])
        write_snapshot(store, state, run, {})
        for row in marker["encoded"]:
            model[row["item_id"]] = ItemState(status=LIVE, shard=marker["shard"], run_id=run,
                                              updated_at=marker["created"], **row)
        model[gone[0]] = dataclasses.replace(model[gone[0]], status=DELETED, run_id=run, updated_at=marker["created"])
        expected = sorted((dataclasses.asdict(i) for i in model.values()), key=lambda r: r["item_id"])
        assert load_state(store, "m").to_table().to_pylist() == expected
    assert list_snapshots(store, "m") == [(1, False), (2, True), (3, True), (4, True), (5, False)], \
        "three nights of 1% change are deltas; 20% more than the share left writes a full snapshot"
    assert pq.read_metadata(tmp_path / "state/model=m/snapshots/00000002.delta.parquet").num_rows == 11


def test_snapshots_a_full_one_replaces_go_after_a_week(tmp_path):
    from imgest.state.clock import now_iso
    from imgest.state.committed import list_snapshots, write_snapshot

    store = Location(str(tmp_path))
    items = {f"k{i}": ItemState(f"k{i}", "u", LIVE, None, 1, 1.0, f"h{i}", "part-r00000001-a-b-00000", None, None,
                                now_iso()) for i in range(10)}
    for seq in (1, 2):
        write_snapshot(store, CatalogueState("m", dict(items)), f"r{seq:08d}-a-b", {})
    old = tmp_path / "state/model=m/snapshots/00000001.parquet"
    week_ago = (datetime.now(UTC) - timedelta(days=8)).timestamp()
    os.utime(old, (week_ago, week_ago))
    write_snapshot(store, CatalogueState("m", dict(items)), "r00000003-a-b", {})
    assert list_snapshots(store, "m") == [(2, False), (3, False)], "the week-old one goes, yesterday's stays"
    assert load_state(store, "m").to_table().num_rows == 10


def test_a_tombstone_keeps_its_shard_for_its_days_then_the_shard_goes(tmp_path):
    """An item deleted from the catalogue can come back (revived from its old row) for TOMBSTONE_DAYS, so its
    shard file stays that long; from then on the tombstone lets go of it, and the file goes unless a live item
    is in it. A shard nothing refers to goes at once. Judged at the `now` passed, never the wall clock."""
    from imgest.state.committed import TOMBSTONE_DAYS, prepare_state, revivable, write_snapshot
    from imgest.state.layout import shard_key

    store = Location(str(tmp_path))
    deleted_at = datetime(2031, 3, 1, tzinfo=UTC)
    shared, alone, orphan = (f"part-r00000001-a-b-{n:05d}" for n in range(3))
    for shard in (shared, alone, orphan):
        store.write_bytes(shard_key("m", shard), b"PAR1")
    stamp = deleted_at.isoformat(timespec="seconds")
    items = {"live": ItemState("live", "u0", LIVE, "e0", 1, 1.0, "h0", shared, "r00000001-a-b", None, stamp),
             "gone": ItemState("gone", "u1", DELETED, "e1", 1, 1.0, "h1", shared, "r00000001-a-b", None, stamp),
             "gone-alone": ItemState("gone-alone", "u2", DELETED, "e2", 1, 1.0, "h2", alone, "r00000001-a-b", None,
                                     stamp)}
    write_snapshot(store, CatalogueState("m", items), "r00000001-a-b", {})
    model = {"slug": "m", "model_id": "test"}

    almost = deleted_at + timedelta(days=TOMBSTONE_DAYS) - timedelta(seconds=1)
    state, removed = prepare_state(store, model, now=almost)
    assert removed == [f"{orphan}.parquet"]
    kept = state.rows(["gone", "gone-alone"])
    assert (kept["gone"].shard, kept["gone-alone"].shard) == (shared, alone)
    assert revivable(kept["gone-alone"], almost) and store.exists(shard_key("m", alone))

    expired = deleted_at + timedelta(days=TOMBSTONE_DAYS)
    state, removed = prepare_state(store, model, now=expired)
    assert removed == [f"{alone}.parquet"], "the expired tombstone's own shard goes, the live item's stays"
    assert not revivable(kept["gone-alone"], expired)
    assert {k: v.shard for k, v in state.rows(["live", "gone", "gone-alone"]).items()} == \
        {"live": shared, "gone": None, "gone-alone": None}
    write_snapshot(store, state, "r00000002-a-b", {})  # the let-go shards are part of the next snapshot
    assert [item.shard for item in load_state(store, "m").rows(["gone", "gone-alone"]).values()] == [None, None]
    assert store.exists(shard_key("m", shared)) and not store.exists(shard_key("m", alone))


def test_the_state_is_queried_on_disk_and_its_folder_goes_with_it(tmp_path):
    """The committed rows stay in a DuckDB database in a folder of their own (never the flow's memory): queries
    see the overlay in place of the rows it replaces, a full snapshot is streamed out and uploaded whole (no
    temp file left), and the folder is gone once the state is."""
    import gc

    from imgest.state.committed import list_snapshots, write_snapshot

    store = Location(str(tmp_path / "store"))
    items = {f"k{i}": ItemState(f"k{i}", "u", LIVE, None, 1, 1.0, f"h{i}", "part-r00000001-a-b-00000", None, None,
                                "2026-11-01T00:00:00+00:00") for i in range(5)}
    write_snapshot(store, CatalogueState("m", items), "r00000001-a-b", {"seeded": 5})
    state = load_state(store, "m")
    folder = state.base.folder
    assert os.path.exists(os.path.join(folder, "state.duckdb")) and state.base.rows == 5 and not state.overlay
    state.delete(["k1", "k3"], "r00000002-a-b", "2026-11-02T00:00:00+00:00")
    assert state.count(LIVE) == 3 and state.count(DELETED) == 2
    assert state.rows(["k1", "k2", "nope"]).keys() == {"k1", "k2"} and state.rows(["k1"])["k1"].status == DELETED
    assert state.live_table()["item_id"].to_pylist() == ["k0", "k2", "k4"]
    state.full_rows = 0  # force a full snapshot: the path a compaction takes
    write_snapshot(store, state, "r00000002-a-b", {})
    assert list_snapshots(store, "m")[-1] == (2, False)
    assert not [n for n in os.listdir(tmp_path / "store/state/model=m/snapshots") if n.startswith(".tmp-")]
    assert load_state(store, "m").count(DELETED) == 2
    del state
    gc.collect()
    assert not os.path.exists(folder)


def test_killed_between_the_snapshot_and_the_marker_deletion_nothing_is_counted_twice(tmp_path):
    """A run killed after its snapshot (a delta here) but before it deleted the commit markers it folded: the
    next load sees them as already folded (their run is not after the snapshot), and the next write drops them."""
    from imgest.state.clock import now_iso
    from imgest.state.committed import list_commits, write_snapshot

    store = Location(str(tmp_path))
    items = {f"k{i:03d}": ItemState(f"k{i:03d}", "u", LIVE, f"e{i}", 1, 1.0, f"h{i}", "part-r00000001-a-b-00000",
                                    "r00000001-a-b", None, "2026-11-01T00:00:00+00:00") for i in range(100)}
    write_snapshot(store, CatalogueState("m", items), "r00000001-a-b", {})
    run = "r00000002-a-b"
    marker = {"shard": f"part-{run}-00000", "run_id": run, "created": now_iso(),
              "encoded": [{"item_id": "new", "uri": "u", "etag": "n", "size": 2, "mtime": 2.0, "content_hash": "hn"}]}
    store.write_json(commit_key("m", marker["shard"]), marker)
    state = load_state(store, "m")
    assert state.pending == [marker["shard"]] and state.count(LIVE) == 101
    write_snapshot(store, state, run, {})
    store.write_json(commit_key("m", marker["shard"]), marker)  # as if killed before the deletion
    again = load_state(store, "m")
    assert again.pending == [] and not again.overlay and again.count(LIVE) == 101
    assert again.to_table().num_rows == 101
    write_snapshot(store, again, "r00000003-a-b", {})
    assert list_commits(store, "m") == []


@pytest.mark.slow("a subprocess")
def test_scratch_folders_of_a_killed_process_are_swept(tmp_path, monkeypatch):
    import subprocess
    import sys

    from imgest.scratch import scratch_folder

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = tmp_path / f"imgest-state-{int(dead.stdout)}-abc"
    left.mkdir()
    (left / "state.duckdb").write_bytes(b"x")
    mine = tmp_path / f"imgest-state-{os.getpid()}-def"
    mine.mkdir()

    class Owner:
        pass

    owner = Owner()
    made = scratch_folder(owner, "state")
    assert not left.exists(), "a dead process's folder goes"
    assert mine.exists() and os.path.isdir(made), "a live process's folders stay"


def test_a_full_snapshot_whose_upload_fails_publishes_nothing_and_keeps_the_markers(tmp_path, monkeypatch):
    """The streamed full snapshot is the run's commit: an upload that fails (a dropped connection) stops the run
    with the markers still in place, no snapshot and no temp file; the next load sees the same state."""
    from imgest.state.clock import now_iso
    from imgest.state.committed import list_commits, list_snapshots, write_snapshot
    from imgest.storage import StorageError

    store = Location(str(tmp_path))
    run = "r00000001-a-b"
    marker = {"shard": f"part-{run}-00000", "run_id": run, "created": now_iso(),
              "encoded": [{"item_id": f"k{i}", "uri": "u", "etag": f"e{i}", "size": 1, "mtime": 1.0,
                           "content_hash": f"h{i}"} for i in range(5)]}
    store.write_json(commit_key("m", marker["shard"]), marker)
    state = load_state(store, "m")

    def dropped(self, key, local_path):
        raise StorageError(f"writing {key} failed: ConnectionError: dropped")

    monkeypatch.setattr(Location, "put_file", dropped)
    with pytest.raises(StorageError, match="dropped"):
        write_snapshot(store, state, run, {})
    assert list_snapshots(store, "m") == [] and list_commits(store, "m") == [marker["shard"]]
    assert not [n for n in os.listdir(state.base.folder) if n.startswith("out-")], "the local file is removed"
    assert load_state(store, "m").count(LIVE) == 5
