"""The writer lock: one holder, stale holders taken over by exactly one successor, and a holder that lost the
lock (paused past the heartbeat window) stopped at its next commit point. Local disk and S3 (moto's server)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from imgest.lock import LockLostError, StoreLock, StoreLockedError, current_holder, generation_key, generations
from imgest.storage import Location


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> Location:
    if request.param == "local":
        return Location(str(tmp_path / "store"))
    import s3fs

    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = f"lock-{os.urandom(4).hex()}"
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}).mkdir(bucket)
    return Location(f"s3://{bucket}/store")


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


def test_a_paused_holder_loses_the_lock_and_cannot_commit_over_its_successor(store):
    paused = StoreLock(store, owner="ingest@paused:1", ttl=1.0, heartbeat=3600)  # no heartbeat: as if stopped
    paused.acquire()
    time.sleep(1.3)
    successor = StoreLock(store, owner="ingest@next:2", ttl=1.0, heartbeat=0.2)
    successor.acquire()
    with pytest.raises(LockLostError, match="lost the writer lock.*generation 2 \\(ingest@next:2\\)"):
        paused.check()  # what every commit point does first
    paused.release()  # leaves the successor's lock alone
    successor.check()
    assert current_holder(store)["owner"] == "ingest@next:2"
    time.sleep(1.3)  # the successor's heartbeat keeps it fresh past ttl
    with pytest.raises(StoreLockedError):
        StoreLock(store, owner="third@x:3", ttl=1.0).acquire()
    successor.release()


def test_racing_breakers_of_a_stale_lock_one_wins(store):
    StoreLock(store, owner="dead@x:1", ttl=0.5, heartbeat=3600).acquire()
    time.sleep(0.8)
    winners, refused = [], []

    def take(n: int) -> None:
        try:
            winners.append(StoreLock(store, owner=f"breaker@{n}", ttl=0.5, heartbeat=3600).acquire())
        except StoreLockedError:
            refused.append(n)

    threads = [threading.Thread(target=take, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1 and len(refused) == 3
    assert generations(store) == [winners[0].generation]


def test_an_empty_lock_file_is_stale_after_the_heartbeat_window(tmp_path):
    store = Location(str(tmp_path / "store"))
    store.write_bytes(generation_key(7), b"")  # a create killed half-way (or a full disk)
    with pytest.raises(StoreLockedError, match="still being written"):
        StoreLock(store, owner="next@x:1", ttl=60).acquire()
    old = time.time() - 120
    os.utime(store.path(generation_key(7)), (old, old))
    lock = StoreLock(store, owner="next@x:1", ttl=60)
    assert lock.acquire().generation == 8
    lock.release()


def test_a_writer_that_lost_the_lock_leaves_no_marker(tmp_path):
    from imgest import encoders
    from imgest.tasks.ingest.plan import ShardPlan, WorkItem
    from imgest.tasks.ingest.shards import ShardWriter
    from imgest.tasks.state.committed import commit_key

    store = Location(str(tmp_path / "store"))
    lost = StoreLock(store, owner="ingest@paused:1", ttl=0.5, heartbeat=3600)
    fence = lost.acquire()
    time.sleep(0.8)
    StoreLock(store, owner="ingest@next:2", ttl=0.5).acquire()
    spec = encoders.resolve("raw-pixels")
    plan = ShardPlan("r00000001-x-y", 0, (WorkItem("a.png", "/a.png", 1, 1.0, None, None),))
    writer = ShardWriter(store, spec, plan, fence)
    writer.reject(plan.items[0], "h", "DecodeError: x")
    with pytest.raises(LockLostError):
        writer.flush()
    assert not store.exists(commit_key(spec.slug, plan.name))
