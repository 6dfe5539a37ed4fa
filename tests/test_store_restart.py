"""The store's server itself failing, not only the client's connection: SeaweedFS killed with SIGKILL in the
middle of an ingest, of an index build and of an alias move, then started again on its data. After each, a
rerun gives the reference result (same ids, content hashes and embeddings, no duplicate, no orphan shard after
the next run); the search service answers from the version it holds while the store is down and follows the
alias again once it is back; a store that stays down stops a run in one line naming the endpoint, never a hang.

SeaweedFS only: moto's server keeps its objects in memory, so a killed moto has nothing to come back to. The
server here is this module's own (its own ports and data), so killing it disturbs no other test."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from imgest.config import IndexConfig, MigrateConfig, NightlyConfig
from imgest.encoders import resolve
from imgest.flows.build_index import build_index
from imgest.flows.migrate import migrate
from imgest.flows.nightly import nightly
from imgest.retrieval.following import FollowingSearcher
from imgest.retrieval.query import Query
from imgest.state.committed import load_state
from imgest.state.lock import generations
from imgest.storage import Location
from tests.helpers import ingest_into, live_rows
from tests.s3servers import SECRET, SeaweedServer
from tests.test_reliability import (
    BUILD,
    INGEST,
    MODEL,
    PROMOTE,
    _bucket,
    _markers,
    _no_secret,
    _put_images,
    _reference,
    _serving_answers,
    _spawn,
    _wait,
)

pytestmark = [pytest.mark.slow("a SeaweedFS server of its own"), pytest.mark.usefixtures("prefect_harness")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    found = SeaweedServer(tmp_path_factory.mktemp("seaweedfs-restarted")).start()
    yield found
    found.stop()


@pytest.fixture
def s3(server, monkeypatch):
    """s3fs on this module's server, its endpoint and keys in the environment as a user sets them; the server
    is running again when the test ends, whatever the test did to it."""
    import s3fs

    for name, value in server.environment().items():
        monkeypatch.setenv(name, value)
    yield s3fs.S3FileSystem(client_kwargs={"endpoint_url": server.url})
    if server.proc is None or server.proc.poll() is not None:
        server.start()


def _restart(server: SeaweedServer, down_s: float) -> float:
    """SIGKILL the store's server, keep it down `down_s`, start it on its data; seconds it did not answer."""
    start = time.monotonic()
    server.kill()
    time.sleep(down_s)
    server.start()
    return time.monotonic() - start


def _shards(s3, store: str) -> set[str]:
    s3.invalidate_cache()
    slug = resolve(MODEL).slug
    return {os.path.basename(p)[:-len(".parquet")] for p in s3.glob(f"{store[5:]}/embeddings/model={slug}/*.parquet")}


def _imgest() -> str:
    return os.path.join(os.path.dirname(sys.executable), "imgest")  # the command a user runs


def _command_env(**extra: str) -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": os.getcwd(), **extra}


def _kill_store_under(server: SeaweedServer, proc: subprocess.Popen, delay: float) -> None:
    """`delay` s into a command, SIGKILL the store's server; the command must end by itself (never hang), then the
    server starts again on its data. A command that outlives that is killed."""
    try:
        time.sleep(delay)
        server.kill()
        proc.wait(timeout=180)
        server.start()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_an_ingest_rides_out_a_restart_of_the_store_and_a_rerun_gives_the_reference(server, s3, tmp_path):
    bucket = _bucket(s3, "ingest")
    catalogue, store = f"s3://{bucket}/cat", f"s3://{bucket}/store"
    _put_images(s3, bucket, range(60))
    log = open(tmp_path / "ingest.log", "w+b")
    # the production backoff: three retries after 2, 4 and 8 s (+-50%) ride out a restart of a few seconds
    proc = _spawn(INGEST, catalogue, store, env={"IMGEST_RETRY_BACKOFF_S": "2"}, log=log)
    try:
        assert _wait(lambda: bool(_markers(s3, bucket)), 120, proc), "no shard committed before the kill"
        outage = _restart(server, 2.0)
        proc.wait(timeout=300)  # never hangs
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log.seek(0)
    assert proc.returncode == 0, f"the run did not ride out a {outage:.1f} s restart:\n{log.read().decode()[-3000:]}"
    assert live_rows(store, MODEL) == _reference(s3, catalogue)
    ingest_into(catalogue, store, model=MODEL, batch_size="4", shard_size=10)  # next run
    referenced = {item.shard for item in load_state(Location(store), resolve(MODEL).slug).live()}
    assert _shards(s3, store) == referenced, "a shard no state refers to outlived the next run"
    _no_secret(log)


def test_ingests_killed_with_the_store_at_random_moments_then_a_rerun_gives_the_reference(server, s3, tmp_path):
    rng = random.Random(20261203)
    bucket = _bucket(s3, "crash")
    catalogue, store = f"s3://{bucket}/cat", f"s3://{bucket}/store"
    _put_images(s3, bucket, range(60))
    endpoint = server.url.split("//")[1]
    outcomes = []
    for round_ in range(3):
        if round_:  # the catalogue moves between nights: new, changed and deleted images
            _put_images(s3, bucket, range(60 + 5 * round_, 65 + 5 * round_))
            _put_images(s3, bucket, [round_], seed=round_ + 1)
            s3.rm(f"{bucket}/cat/p/{20 + round_:03d}.png")
        # the command a user runs, with short retries: a run that meets the store down stops instead of riding
        # the outage out, and says so in one line
        proc = subprocess.Popen([_imgest(), "ingest", "--catalogue", catalogue, "--store", store, "--model", MODEL,
                                 "--batch-size", "2", "--shard-size", "3"],
                                env=_command_env(IMGEST_RETRY_BACKOFF_S="0.05"), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _wait(lambda: bool(generations(Location(store))), 120, proc)
            time.sleep(rng.uniform(0.0, 3.0))  # listing, encoding or committing
            server.kill()
            out, err = proc.communicate(timeout=180)  # a store gone mid-run ends the run: it never hangs
            server.start()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        outcomes.append(proc.returncode)
        assert SECRET not in out + err
        if proc.returncode:  # the run met the store down: one line, naming the endpoint, exit 2
            last = err.strip().splitlines()[-1]
            assert proc.returncode == 2 and last.startswith("imgest: error:") and endpoint in last, err[-3000:]
            assert "did not answer" in last and "run again" in last, last
        ingest_into(catalogue, store, model=MODEL, batch_size="4", shard_size=10)
        assert live_rows(store, MODEL) == _reference(s3, catalogue), f"round {round_}"
    assert any(outcomes), "no run met the store down: the kills all came after the runs ended"


def test_index_build_and_alias_move_killed_with_the_store(server, s3, tmp_path, tiny_models):
    rng = random.Random(11)
    bucket = _bucket(s3, "index")
    catalogue, store = f"s3://{bucket}/cat", f"s3://{bucket}/store"
    _put_images(s3, bucket, range(40))
    nightly(NightlyConfig(catalogue=catalogue, store=store, model=MODEL, batch_size="4"))
    logs = []
    for round_ in range(2):
        log = open(tmp_path / f"build-{round_}.log", "w+b")
        logs.append(log)
        before = len(generations(Location(store)))
        proc = _spawn(BUILD, store, env={"IMGEST_RETRY_BACKOFF_S": "0.05"}, log=log)
        _wait(lambda before=before: len(generations(Location(store))) > before, 60, proc)
        _kill_store_under(server, proc, rng.uniform(0.2, 2.0))
        assert _serving_answers(store) == resolve(MODEL).slug  # a half-written version is never served
    built = build_index(IndexConfig(store=store, model=MODEL, kind="hnsw", rebuild=True))
    assert built["built"] and _serving_answers(store) == resolve(MODEL).slug

    new = f"hf:{tiny_models['dinov2']}"
    migrate(MigrateConfig(store=store, action="start", to=new, batch_size="4", catalogue=catalogue))
    log = open(tmp_path / "promote.log", "w+b")
    logs.append(log)
    proc = _spawn(PROMOTE, store, env={"IMGEST_RETRY_BACKOFF_S": "0.05"}, log=log)
    _kill_store_under(server, proc, rng.uniform(1.0, 4.0))
    assert _serving_answers(store) in (resolve(MODEL).slug, resolve(new).slug)  # the old or the new, whole
    if _serving_answers(store) == resolve(MODEL).slug:
        migrate(MigrateConfig(store=store, action="promote", force="store restart test: no evaluation"))
    assert _serving_answers(store) == resolve(new).slug
    _no_secret(*logs)


def test_the_search_service_answers_while_the_store_is_down_and_follows_the_alias_after(server, s3, tmp_path):
    bucket = _bucket(s3, "serve")
    catalogue, store = f"s3://{bucket}/cat", f"s3://{bucket}/store"
    _put_images(s3, bucket, range(30))
    nightly(NightlyConfig(catalogue=catalogue, store=store, model=MODEL, batch_size="4"))
    following = FollowingSearcher(store)
    assert following.refresh() == ["serving"]
    first = following.status()["serving"]["version"]
    item = next(iter(load_state(Location(store), resolve(MODEL).slug).live()))
    query = Query("q", image_bytes=s3.cat(item.uri[5:]))  # an upload: the store is not read to take it

    server.kill()
    try:
        answer = following.search([query], k=3)
        assert answer.hits[0][0].item_id == item.item_id  # from the index it holds
        assert following.refresh() == []  # what the alias names cannot be read: it keeps what it has
        status = following.status()["serving"]
        assert status["version"] == first and status["error"] and server.url.split("//")[1] in status["error"]
        assert following.search([query], k=3).hits[0][0].item_id == item.item_id
    finally:
        server.start()
    build_index(IndexConfig(store=store, model=MODEL, kind="hnsw", rebuild=True))  # the alias moves on
    assert following.refresh() == ["serving"]
    status = following.status()["serving"]
    assert status["version"] > first and status["error"] is None
    assert following.search([query], k=3).hits[0][0].item_id == item.item_id


def test_a_store_that_stays_down_stops_the_run_in_one_line(server, s3, tmp_path):
    bucket = _bucket(s3, "down")
    _put_images(s3, bucket, range(8))
    catalogue, store = f"s3://{bucket}/cat", f"s3://{bucket}/store"
    ingest_into(catalogue, store, model=MODEL, batch_size="4")
    server.kill()
    try:
        started = time.monotonic()
        done = subprocess.run([_imgest(), "ingest", "--catalogue", catalogue, "--store", store, "--model", MODEL],
                              env=_command_env(IMGEST_RETRY_BACKOFF_S="0.05"), capture_output=True, text=True,
                              timeout=300)
        took = time.monotonic() - started
    finally:
        server.start()
    last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert server.url.split("//")[1] in last and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "did not answer" in last and "run again" in last, last
    assert SECRET not in done.stdout + done.stderr
    assert took < 240, f"a store that stays down took {took:.0f} s to give up"
