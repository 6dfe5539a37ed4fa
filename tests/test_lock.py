"""The writer lock: one holder, stale holders taken over by exactly one successor, and a holder that lost the
lock (paused past the heartbeat window) stopped at its next commit point. Local disk and S3 (moto's server and
SeaweedFS on loopback).
Time is the locks' injected clock, moved by the tests (`clock`); heartbeats are beaten by hand (`renew`), except in
the one test of the real heartbeat thread."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from imgest.state.layout import generation_key
from imgest.state.lock import LockLostError, StoreLock, StoreLockedError, current_holder, generations
from imgest.storage import Location
from tests.s3servers import on as on_s3
from tests.s3servers import use as use_s3

TTL = 60.0


def _store(request, tmp_path) -> Location:
    if request.param == "local":
        return Location(str(tmp_path / "store"))
    import s3fs

    endpoint = use_s3(request, request.param)
    bucket = f"lock-{os.urandom(4).hex()}"
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}).mkdir(bucket)
    return Location(f"s3://{bucket}/store")


@pytest.fixture(params=["local", *on_s3("moto", "seaweedfs")])
def store(request, tmp_path) -> Location:
    return _store(request, tmp_path)


# Not moto: its server checks If-None-Match, then stores, without a lock between, so two racing creates can both
# pass there. A disk's O_EXCL and SeaweedFS's create are atomic, as S3's is.
@pytest.fixture(params=["local", *on_s3("seaweedfs")])
def atomic_store(request, tmp_path) -> Location:
    return _store(request, tmp_path)


def test_one_holder_at_a_time_then_the_next_generation(store):
    first = StoreLock(store, owner="ingest@a:1")
    fence = first.acquire()
    with pytest.raises(StoreLockedError, match="locked by run ingest@a:1"):
        StoreLock(store, owner="ingest@b:2").acquire()
    assert current_holder(store)["owner"] == "ingest@a:1"
    first.release()
    assert current_holder(store) is None
    with StoreLock(store, owner="ingest@b:2") as second:
        assert second.fence.generation == fence.generation + 1
        second.check()
    with pytest.raises(LockLostError):
        fence.check(store)  # an old generation never passes again


def test_a_paused_holder_loses_the_lock_and_cannot_commit_over_its_successor(store, clock):
    paused = StoreLock(store, owner="ingest@paused:1", ttl=TTL, heartbeat=3600, clock=clock)  # no beat: as if stopped
    paused.acquire()
    clock.advance(TTL - 1)
    with pytest.raises(StoreLockedError, match="locked by run ingest@paused:1"):
        StoreLock(store, owner="ingest@next:2", ttl=TTL, clock=clock).acquire()  # silent, but not for the ttl yet
    clock.advance(2)
    successor = StoreLock(store, owner="ingest@next:2", ttl=TTL, heartbeat=3600, clock=clock)
    successor.acquire()
    with pytest.raises(LockLostError, match="lost the writer lock.*generation 2 \\(ingest@next:2\\)"):
        paused.check()  # what every commit point does first
    paused.release()  # leaves the successor's lock alone
    assert not paused.renew() and paused.lost, "a generation that is no longer ours is never renewed"
    successor.check()
    assert current_holder(store, clock())["owner"] == "ingest@next:2"
    clock.advance(0.6 * TTL)
    assert successor.renew()
    clock.advance(0.6 * TTL)  # past the ttl since it took the lock, within it since its last beat
    with pytest.raises(StoreLockedError, match="locked by run ingest@next:2"):
        StoreLock(store, owner="third@x:3", ttl=TTL, clock=clock).acquire()
    clock.advance(0.6 * TTL)  # no beat for longer than the ttl: taken over
    third = StoreLock(store, owner="third@x:3", ttl=TTL, heartbeat=3600, clock=clock)
    assert third.acquire().generation == 3
    successor.release()
    third.release()


def test_the_heartbeat_thread_beats_on_the_clock_and_ends_once_the_lock_is_lost(store, clock):
    """The one test of the real heartbeat thread (the others beat by hand): every `heartbeat` seconds it writes the
    clock's time into the lock file, which keeps the store held past the ttl, and it ends once a successor took
    the store, leaving the successor's lock alone. Waits on the thread's writes, a few milliseconds."""
    beat_at_clock = threading.Event()
    write = store.write_bytes

    def write_and_see(key: str, data: bytes) -> None:
        write(key, data)
        if key == generation_key(1) and json.loads(data)["heartbeat"] == clock.now:
            beat_at_clock.set()

    store.write_bytes = write_and_see
    lock = StoreLock(store, owner="ingest@beating:1", ttl=TTL, heartbeat=0.01, clock=clock)
    assert lock.acquire().generation == 1
    clock.advance(2 * TTL)
    assert beat_at_clock.wait(timeout=10), "the heartbeat thread wrote no beat at the clock's time"
    with pytest.raises(StoreLockedError, match="locked by run ingest@beating:1"):
        StoreLock(store, owner="ingest@next:2", ttl=TTL, clock=clock).acquire()
    # a successor that heard no beat for two ttls (this process stopped meanwhile) takes the store
    successor = StoreLock(store, owner="ingest@next:2", ttl=TTL, heartbeat=3600, clock=lambda: clock.now + 2 * TTL)
    assert successor.acquire().generation == 2
    lock._thread.join(timeout=10)
    assert lock.lost and not lock._thread.is_alive(), "the thread ends at its first beat after the take-over"
    lock.release()
    successor.check()
    assert current_holder(store, clock())["owner"] == "ingest@next:2"
    successor.release()


def test_racing_breakers_of_a_stale_lock_one_wins(atomic_store):
    store = atomic_store
    # The dead holder's last heartbeat is stamped TTL + 1 s ago; the breakers read the real time, the time the
    # store stamps files with: a breaker that finds a rival's lock file still empty judges it by its mtime,
    # which must be on the same clock, or a file written a moment ago would look stale.
    dead = StoreLock(store, owner="dead@x:1", ttl=TTL, heartbeat=3600, clock=lambda: time.time() - TTL - 1)
    dead.acquire()
    breakers = [StoreLock(store, owner=f"breaker@{n}", ttl=TTL, heartbeat=3600) for n in range(4)]
    winners, refused = [], []

    def take(n: int) -> None:
        try:
            winners.append(breakers[n].acquire())
        except StoreLockedError:
            refused.append(n)

    threads = [threading.Thread(target=take, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1 and len(refused) == 3
    assert generations(store) == [1, winners[0].generation] == [1, 2]  # the one taken over stays, as a floor
    for lock in (dead, *breakers):
        lock.release()


def test_an_empty_lock_file_is_stale_after_the_heartbeat_window(tmp_path, clock):
    store = Location(str(tmp_path / "store"))
    store.write_bytes(generation_key(7), b"")  # a create killed half-way (or a full disk)
    with pytest.raises(StoreLockedError, match="still being written"):
        StoreLock(store, owner="next@x:1", ttl=TTL, clock=clock).acquire()
    clock.advance(TTL - 5)
    with pytest.raises(StoreLockedError, match="still being written.*in 5 s"):
        StoreLock(store, owner="next@x:1", ttl=TTL, clock=clock).acquire()
    clock.advance(10)  # not written for longer than the ttl
    lock = StoreLock(store, owner="next@x:1", ttl=TTL, heartbeat=3600, clock=clock)
    assert lock.acquire().generation == 8
    lock.release()


def test_a_writer_that_lost_the_lock_leaves_no_marker(tmp_path, clock):
    from imgest import encoders
    from imgest.state.layout import commit_key
    from imgest.tasks.ingest.plan import ShardPlan, WorkItem
    from imgest.tasks.ingest.writer import ShardWriter

    store = Location(str(tmp_path / "store"))
    lost = StoreLock(store, owner="ingest@paused:1", ttl=TTL, heartbeat=3600, clock=clock)
    fence = lost.acquire()
    clock.advance(TTL + 1)  # paused past the ttl: a successor takes the store
    successor = StoreLock(store, owner="ingest@next:2", ttl=TTL, heartbeat=3600, clock=clock)
    successor.acquire()
    spec = encoders.resolve("raw-pixels")
    plan = ShardPlan("r00000001-x-y", 0, (WorkItem("a.png", "/a.png", 1, 1.0, None, None),))
    writer = ShardWriter(store, spec, plan, fence)
    writer.reject(plan.items[0], "h", "DecodeError: x")
    with pytest.raises(LockLostError):
        writer.flush()
    assert not store.exists(commit_key(spec.slug, plan.name))
    lost.release()
    successor.release()
