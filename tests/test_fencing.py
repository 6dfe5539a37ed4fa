"""Fencing that holds against a paused writer: records replaced in place (aliases, the migration window) are
written by compare-and-swap after the fence check, so a writer paused between its check and its write cannot
overwrite what its successor wrote; a lock file with garbage fields is a clear refusal, then a take-over. Local
disk and S3 (moto's server and SeaweedFS on loopback)."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import TYPE_CHECKING

import pytest

from imgest.state.aliases import delete_alias, read_alias, set_alias
from imgest.state.layout import generation_key
from imgest.state.lock import (
    LockLostError,
    RecordChangedError,
    StoreLock,
    StoreLockedError,
    current_holder,
    generations,
)
from imgest.storage import Location, RecordError
from imgest.tasks.migration import window as migration
from tests.s3servers import on as on_s3
from tests.s3servers import use as use_s3

if TYPE_CHECKING:
    from tests.conftest import Clock  # the time the locks see (the `clock` fixture): moved, never slept through

TTL = 60.0


def _store_url(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "store")
    import s3fs

    endpoint = use_s3(request, request.param)
    bucket = f"fence-{os.urandom(4).hex()}"
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}).mkdir(bucket)
    return f"s3://{bucket}/store"


@pytest.fixture(params=["local", *on_s3("moto", "seaweedfs")])
def store_url(request, tmp_path) -> str:
    return _store_url(request, tmp_path)


# Not moto: its server checks If-Match, then stores, without a lock between, so racing writers from one read can
# both pass there. A disk's flock and SeaweedFS are atomic, as S3 is.
@pytest.fixture(params=["local", *on_s3("seaweedfs")])
def atomic_store_url(request, tmp_path) -> str:
    return _store_url(request, tmp_path)


def card(version: int, slug: str = "m-1a2b3c4d") -> dict:
    return {"slug": slug, "model_id": "hf:tiny@abc", "version": version, "sha256": f"{version:064x}"}


def pause_before_write(store: Location, while_paused) -> list[str]:
    """Run `while_paused` at the moment `store`'s writer has passed its fence check and is about to write (its
    next conditional write or delete), as if the process were stopped there. Returns the keys it paused on."""
    paused: list[str] = []

    def hook(method):
        def call(key, *args):
            if not paused:
                paused.append(key)
                while_paused()
            return method(key, *args)
        return call

    store.write_if = hook(store.write_if)
    store.delete_if = hook(store.delete_if)
    return paused


def take_over(url: str, clock: Clock, owner: str = "successor@b:2") -> StoreLock:
    """The predecessor has been silent past the ttl: a successor takes the lock."""
    clock.advance(TTL + 5)
    lock = StoreLock(Location(url), owner=owner, ttl=TTL, heartbeat=3600, clock=clock)
    lock.acquire()
    return lock


def writer(url: str, clock: Clock) -> tuple[Location, StoreLock]:
    store = Location(url)  # each writer its own Location: the pause is injected into A's only
    lock = StoreLock(store, owner="paused@a:1", ttl=TTL, heartbeat=3600, clock=clock)  # no beat: as if stopped
    lock.acquire()
    return store, lock


def test_a_paused_alias_move_cannot_overwrite_its_successors(store_url, clock):
    set_alias(Location(store_url), "serving", card(1), "first")
    store_a, lock_a = writer(store_url, clock)
    successor: list[StoreLock] = []

    def meanwhile():
        lock_a.check()  # A really passed its fence: it held the lock when it stopped
        successor.append(take_over(store_url, clock))
        set_alias(Location(store_url), "serving", card(3), "successor's build", successor[0].fence)

    paused = pause_before_write(store_a, meanwhile)
    with pytest.raises(LockLostError, match="lost the writer lock.*aliases/serving.json was changed"):
        set_alias(store_a, "serving", card(2), "late build", lock_a.fence)
    assert paused == ["aliases/serving.json"]
    serving = read_alias(Location(store_url), "serving")
    assert (serving["version"], serving["reason"]) == (3, "successor's build")
    assert [h["version"] for h in serving["history"]] == [1], "the late move left no trace"
    successor[0].release()
    lock_a.release()  # leaves the successor's (released) lock alone


def test_a_paused_alias_delete_cannot_remove_its_successors_move(store_url, clock):
    set_alias(Location(store_url), "shadow", card(1), "first")
    store_a, lock_a = writer(store_url, clock)
    successor: list[StoreLock] = []

    def meanwhile():
        successor.append(take_over(store_url, clock))
        set_alias(Location(store_url), "shadow", card(4), "successor's shadow", successor[0].fence)

    pause_before_write(store_a, meanwhile)
    with pytest.raises(LockLostError, match="aliases/shadow.json was changed"):
        delete_alias(store_a, "shadow", lock_a.fence)
    assert read_alias(Location(store_url), "shadow")["version"] == 4
    successor[0].release()


def open_test_window(store: Location) -> dict:
    window = {"id": "w-20260101T000000-abcdef", "status": "open", "events": [], "catalogue": None,
              "from": {"name": "old", "slug": "old-1a2b3c4d", "model_id": "hf:old@1", "dim": 4},
              "to": {"name": "new", "slug": "new-1a2b3c4d", "model_id": "hf:new@1", "dim": 4},
              "opened_at": "2026-01-01T00:00:00+00:00", "opened_by": "test@host"}
    store.write_json(migration.WINDOW_KEY, window)
    return window


def test_a_paused_window_record_cannot_overwrite_its_successors(store_url, clock):
    window = open_test_window(Location(store_url))
    store_a, lock_a = writer(store_url, clock)
    successor: list[StoreLock] = []

    def meanwhile():
        successor.append(take_over(store_url, clock))
        fresh = migration.read_window(Location(store_url))
        fresh["status"] = "rolled_back"
        migration.record(Location(store_url), fresh, "rolled_back", successor[0].fence)

    pause_before_write(store_a, meanwhile)
    window["status"] = "promoted"
    with pytest.raises(LockLostError, match="migration/window.json was changed"):
        migration.record(store_a, window, "promoted", lock_a.fence)
    stored = migration.read_window(Location(store_url))
    assert stored["status"] == "rolled_back" and [e["event"] for e in stored["events"]] == ["rolled_back"]
    successor[0].release()


def test_a_paused_window_record_cannot_bring_back_a_finished_window(store_url, clock):
    window = open_test_window(Location(store_url))
    store_a, lock_a = writer(store_url, clock)
    successor: list[StoreLock] = []

    def meanwhile():
        successor.append(take_over(store_url, clock))
        migration.finish(Location(store_url), retain_days=7, fence=successor[0].fence)

    pause_before_write(store_a, meanwhile)
    with pytest.raises(LockLostError):
        migration.record(store_a, window, "shadow-index", lock_a.fence, version=2)
    assert migration.read_window(Location(store_url)) is None, "the finished window stays finished"
    history = Location(store_url).read_json(f"migration/history/{window['id']}.json")
    assert history["status"] == "finished"
    # and a writer that still holds the lock, with a window read before it was finished, is refused too
    with pytest.raises(RecordChangedError, match="no longer the open one"):
        migration.record(Location(store_url), window, "late", successor[0].fence)
    assert migration.read_window(Location(store_url)) is None
    successor[0].release()


def test_a_paused_finish_cannot_delete_its_successors_window(store_url, clock):
    window = open_test_window(Location(store_url))
    store_a, lock_a = writer(store_url, clock)
    successor: list[StoreLock] = []
    set_alias(Location(store_url), "serving", card(1, window["to"]["slug"]), "promoted")

    def meanwhile():  # A stopped before its first conditional write of finish: its `finished` record
        successor.append(take_over(store_url, clock))
        fresh = migration.read_window(Location(store_url))
        migration.record(Location(store_url), fresh, "reencode-finished", successor[0].fence)

    pause_before_write(store_a, meanwhile)
    with pytest.raises(LockLostError):
        migration.finish(store_a, retain_days=7, fence=lock_a.fence)
    stored = migration.read_window(Location(store_url))
    assert stored["status"] == "open" and [e["event"] for e in stored["events"]] == ["reencode-finished"]
    assert Location(store_url).list_names("migration/retire") == [], "no model scheduled for deletion"
    successor[0].release()


# -- compare-and-swap in the storage layer -----------------------------------------------------------------

def test_two_writers_from_the_same_read_one_wins(store_url):
    one, two = Location(store_url), Location(store_url)
    assert one.read_versioned("aliases/x.json") == (None, None)
    assert one.write_if("aliases/x.json", b"v0", None) is not None
    assert two.write_if("aliases/x.json", b"other", None) is None, "must-not-exist met an object"
    data, token = one.read_versioned("aliases/x.json")
    assert data == b"v0" and two.read_versioned("aliases/x.json") == (data, token)
    new = one.write_if("aliases/x.json", b"v1", token)
    assert new is not None and new != token
    assert two.write_if("aliases/x.json", b"v2", token) is None, "the second writer from the same read loses"
    assert two.read_versioned("aliases/x.json") == (b"v1", new)
    assert not two.delete_if("aliases/x.json", token), "a delete from an old read loses too"
    assert two.delete_if("aliases/x.json", new) and not two.exists("aliases/x.json")
    assert two.write_if("aliases/x.json", b"v3", new) is None, "a version that is gone matches nothing"
    assert not two.exists("aliases/x.json")
    assert one.create_exclusive("aliases/y.json", b"first") and not two.create_exclusive("aliases/y.json", b"second")
    assert two.read_bytes("aliases/y.json") == b"first"
    one.write_bytes("aliases/big.json", b"x" * 100)
    with pytest.raises(RecordError, match="100 bytes or more, over the 99-byte limit"):
        one.read_versioned("aliases/big.json", limit=99)  # refused before it is read


def test_racing_writers_from_the_same_read_exactly_one_wins(atomic_store_url):
    key = "migration/window.json"
    for trial in range(20):
        Location(atomic_store_url).write_bytes(key, b"start %d" % trial)
        _, token = Location(atomic_store_url).read_versioned(key)
        barrier, results = threading.Barrier(4), []

        def write(n: int, barrier=barrier, results=results, token=token) -> None:
            store = Location(atomic_store_url)
            barrier.wait()
            results.append((n, store.write_if(key, b"writer %d" % n, token)))

        threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [n for n, new in results if new is not None]
        assert len(winners) == 1, results
        assert Location(atomic_store_url).read_bytes(key) == b"writer %d" % winners[0]
    assert Location(atomic_store_url).list_names("migration", temp=True) == ["window.json"], "no temp left"


# -- lock files with garbage fields --------------------------------------------------------------------------

GOOD = {"token": "t" * 32, "owner": "ingest@elsewhere:7", "host": "elsewhere", "pid": 7, "started": "2026-01-01"}

GARBAGE = {
    "text pid": {**GOOD, "pid": "seven"},
    "huge pid": {**GOOD, "host": "THIS", "pid": 10**30},
    "negative pid": {**GOOD, "host": "THIS", "pid": -1},
    "text heartbeat": {**GOOD, "heartbeat": "a minute ago"},
    "heartbeat not a number": {**GOOD, "heartbeat": float("nan")},
    "heartbeat far in the future": {**GOOD, "heartbeat": 1e15},
    "released as text": {**GOOD, "released": "no"},
    "owner a list": {**GOOD, "owner": ["a", "b"]},
    "no fields": {},
    "a huge file": {**GOOD, "owner": "x" * 100_000},
    "a list": [1, 2, 3],
}


def plant(store: Location, payload, generation: int = 5) -> None:
    if isinstance(payload, dict) and payload.get("host") == "THIS":
        import socket

        payload = {**payload, "host": socket.gethostname()}
    if isinstance(payload, dict) and "heartbeat" not in payload and payload:
        payload = {**payload, "heartbeat": time.time()}
    store.write_bytes(generation_key(generation), json.dumps(payload).encode())


@pytest.mark.parametrize("name", list(GARBAGE))
def test_a_lock_file_with_garbage_fields_is_refused_clearly_then_taken_over(store_url, name, clock):
    store = Location(store_url)
    plant(store, GARBAGE[name])
    with pytest.raises(StoreLockedError, match="malformed.*taken over 60 s after that") as refused:
        StoreLock(store, owner="next@x:1", ttl=TTL, clock=clock).acquire()
    assert "Traceback" not in str(refused.value)
    holder = current_holder(store)  # what `imgest status` shows
    assert holder["owner"].startswith("unknown (malformed lock file") and holder["malformed"]
    assert {"owner", "host", "pid", "started"} <= set(holder)
    clock.advance(TTL + 5)  # nobody rewrote it for the ttl: taken over
    lock = StoreLock(store, owner="next@x:1", ttl=TTL, heartbeat=3600, clock=clock)
    assert lock.acquire().generation == 6
    assert generations(store) == [5, 6]  # the malformed file it took over stays until the next takeover
    lock.release()


def test_a_fresh_lock_of_a_live_local_process_is_never_taken_over(tmp_path, clock):
    store = Location(str(tmp_path / "store"))
    holder = StoreLock(store, owner="ingest@here:1", ttl=TTL, heartbeat=3600, clock=clock)
    holder.acquire()
    clock.advance(TTL / 2)
    with pytest.raises(StoreLockedError, match="locked by run ingest@here:1"):
        StoreLock(store, owner="next@x:1", ttl=TTL, clock=clock).acquire()
    holder.release()


def test_a_malformed_lock_file_of_a_live_local_process_is_never_taken_over(tmp_path, clock):
    store = Location(str(tmp_path / "store"))
    plant(store, {**GARBAGE["text heartbeat"], "host": "THIS", "pid": os.getpid()})
    clock.advance(10 * TTL)
    with pytest.raises(StoreLockedError, match=f"alive on this host \\(pid {os.getpid()}\\).*not taken over"):
        StoreLock(store, owner="next@x:1", ttl=TTL, clock=clock).acquire()


def test_status_with_a_garbage_lock_exits_cleanly(tmp_path):
    from typer.testing import CliRunner

    from imgest.cli import app

    store = Location(str(tmp_path / "store"))
    for payload in (GARBAGE["huge pid"], GARBAGE["a list"]):
        plant(store, payload)
        result = CliRunner().invoke(app, ["status", "--store", store.url])
        assert result.exit_code == 0, result.output
        assert "running: unknown (malformed lock file locks/writer/000000000005.json" in result.output
        result = CliRunner().invoke(app, ["status", "--store", store.url, "--json"])
        assert result.exit_code == 0 and json.loads(result.output)["running"]["pid"] is None


def test_a_retired_model_is_kept_until_its_retention_has_passed(tmp_path):
    """finish schedules the model no longer serving for deletion `retain_days` after the time it is given;
    collection before that date deletes nothing, after it deletes the model's data and stamps the record."""
    from datetime import UTC, datetime, timedelta

    from imgest.state.layout import embeddings_prefix
    from imgest.state.retention import collect_retired

    store = Location(str(tmp_path / "store"))
    window = open_test_window(store)
    set_alias(store, "serving", card(1, window["to"]["slug"]), "promoted")
    store.write_bytes(f"{embeddings_prefix('old-1a2b3c4d')}/part-00000.parquet", b"old vectors")
    closed = datetime(2031, 3, 1, 12, 0, tzinfo=UTC)
    finished = migration.finish(store, retain_days=7, now=closed)
    assert finished["deleted"] == [] and store.exists(f"{embeddings_prefix('old-1a2b3c4d')}/part-00000.parquet")
    record = store.read_json("migration/retire/old-1a2b3c4d.json")
    assert record["retire_after"] == "2031-03-08T12:00:00+00:00"
    assert collect_retired(store, now=closed + timedelta(days=7) - timedelta(seconds=1)) == []
    assert collect_retired(store, now=closed + timedelta(days=7)) == ["old-1a2b3c4d"]
    assert not store.exists(f"{embeddings_prefix('old-1a2b3c4d')}/part-00000.parquet")
    assert store.read_json("migration/retire/old-1a2b3c4d.json")["deleted_at"] == "2031-03-08T12:00:00+00:00"


def test_finish_run_again_after_the_window_closed_says_so_and_resumes_the_deletion(tmp_path):
    """A finish killed after it closed the window (or simply run twice) is a rerun that should be a no-op: it says
    the window had already finished and goes on deleting what the retention allows, where the first stopped."""
    from datetime import UTC, datetime, timedelta

    from imgest.state.layout import embeddings_prefix

    store = Location(str(tmp_path / "store"))
    with pytest.raises(migration.MigrationError, match="no migration window is open"):
        migration.finish(store, retain_days=7)  # nothing was ever open: still refused
    window = open_test_window(store)
    set_alias(store, "serving", card(1, window["to"]["slug"]), "promoted")
    store.write_bytes(f"{embeddings_prefix('old-1a2b3c4d')}/part-00000.parquet", b"old vectors")
    closed = datetime(2031, 3, 1, 12, 0, tzinfo=UTC)
    first = migration.finish(store, retain_days=7, now=closed)
    assert not first.get("already_finished") and first["deleted"] == []
    again = migration.finish(store, retain_days=7, now=closed + timedelta(days=8))
    assert again["already_finished"] and again["window"]["id"] == window["id"]
    assert again["window"]["status"] == "finished" and again["deleted"] == ["old-1a2b3c4d"]
    assert migration.read_window(store) is None
    from imgest.reports.migration import render_finished

    assert render_finished(again).startswith(f"Window {window['id']} had already finished; deleted now:")
