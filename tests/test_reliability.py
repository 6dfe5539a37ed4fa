"""Fault suite, seeded and bounded, against the loopback S3 endpoint: kill -9 of a whole ingest at random
moments, the endpoint cut for 20 s mid-run, a lock holder paused past the heartbeat window, two ingests
started together, kills during build-index and during promote. After each, a clean run: the live set equals
a clean run's on a fresh store (ids, content hashes, embeddings), with no duplicate, `serving` answers, and
nothing secret was printed. Each runs on moto's server and on SeaweedFS; figures go to $IMGEST_RELIABILITY_OUT
(JSON, by server) when set; BENCHMARKS.md has them."""

from __future__ import annotations

import json
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
from imgest.retrieval.query import Query, Searcher
from imgest.state.committed import load_state
from imgest.state.lock import generations
from imgest.storage import Location
from tests.helpers import TcpProxy, gradient, ingest_into, live_rows, png_bytes
from tests.s3servers import SECRET

pytestmark = pytest.mark.usefixtures("prefect_harness")
MODEL = "raw-pixels"
FIGURES: dict[str, dict[str, dict]] = {}  # server -> scenario -> figures
STARTING_GUN = """
import os, sys, time
import imgest.flows.ingest
open(sys.argv[3], "w").close()
while not os.path.exists(sys.argv[4]):
    time.sleep(0.005)
"""
INGEST = """
import sys
from imgest.flows.ingest import ingest
ingest(config=dict(catalogue=sys.argv[1], store=sys.argv[2], model="raw-pixels", batch_size="2", shard_size=3))
"""


@pytest.fixture
def s3_endpoint(s3_each_endpoint):
    """The fault suite runs on each server: how a server answers a cut, a restart or a race is where they differ."""
    return s3_each_endpoint


@pytest.fixture
def s3(s3_endpoint):
    import s3fs

    return s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})


@pytest.fixture
def figures(request, s3_endpoint) -> dict[str, dict]:
    """The figures of the scenarios run on this test's server."""
    return FIGURES.setdefault(request.node.callspec.params["s3_each_endpoint"], {})


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    out = os.environ.get("IMGEST_RELIABILITY_OUT")
    if out:
        with open(out, "w") as fh:
            json.dump(FIGURES, fh, indent=2)


def _bucket(s3, name: str) -> str:
    bucket = f"{name}-{os.urandom(3).hex()}"
    s3.mkdir(bucket)
    return bucket


def _put_images(s3, bucket: str, keys: range | list[int], seed: int = 0) -> None:
    for i in keys:
        s3.pipe(f"{bucket}/cat/p/{i:03d}.png", png_bytes(gradient(seed * 1000 + i, (48, 48))))


def _reference(s3, catalogue: str) -> dict:
    store = f"s3://{_bucket(s3, 'ref')}/store"
    ingest_into(catalogue, store, model=MODEL, batch_size="4", shard_size=10)
    return live_rows(store, MODEL)


def _spawn(script: str, *args: str, env: dict | None = None, log=None) -> subprocess.Popen:
    from prefect.settings import PREFECT_API_URL

    full = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": os.getcwd(), **(env or {})}
    return subprocess.Popen([sys.executable, "-c", script, *args], env=full, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # its own process group: kill -9 reaches every child


def _wait(predicate, timeout: float, proc: subprocess.Popen | None = None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc is not None and proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def _markers(s3, bucket: str) -> list[str]:
    s3.invalidate_cache()
    return s3.glob(f"{bucket}/store/state/model=*/commits/*.json")


def _no_secret(*logs) -> None:
    for log in logs:
        log.seek(0)
        text = log.read().decode(errors="replace")
        assert SECRET not in text, "the secret key was printed"


def test_kill_9_at_random_moments_then_a_clean_rerun(s3, figures, tmp_path):
    rng = random.Random(20261130)
    bucket = _bucket(s3, "kill")
    catalogue, store = f"s3://{bucket}/cat", f"s3://{bucket}/store"
    _put_images(s3, bucket, range(60))
    kills = survived = lost = duplicates = 0
    logs = []
    for round_ in range(4):
        if round_:  # the catalogue moves between nights: 6 new, 1 changed, 1 deleted
            _put_images(s3, bucket, range(60 + 6 * round_, 66 + 6 * round_))
            _put_images(s3, bucket, [round_], seed=round_ + 1)
            s3.rm(f"{bucket}/cat/p/{10 + round_:03d}.png")
        log = open(tmp_path / f"kill-{round_}.log", "w+b")
        logs.append(log)
        proc = _spawn(INGEST, catalogue, store, log=log)
        started = _wait(lambda: bool(generations(Location(store))), 120, proc)
        time.sleep(rng.uniform(0.0, 4.0))  # a random moment of the run: listing, encoding, committing
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            kills += 1
        else:
            survived += 1
        proc.wait()
        assert started or proc.returncode == 0
        ingest_into(catalogue, store, model=MODEL, batch_size="4", shard_size=10)  # the clean rerun
        live, expected = live_rows(store, MODEL), _reference(s3, catalogue)
        lost += len(set(expected) - set(live))
        assert live == expected
    _no_secret(*logs)
    figures["kill -9 during ingest"] = {"faults": kills, "finished before the kill": survived, "items lost": lost,
                                        "duplicates": duplicates, "runs after": 4}


def test_the_endpoint_cut_for_20_seconds_mid_run(s3, figures, s3_endpoint, tmp_path):
    bucket = _bucket(s3, "cut")
    catalogue, store = f"s3://{bucket}/cat", f"s3://{bucket}/store"
    _put_images(s3, bucket, range(60))
    host, port = s3_endpoint.removeprefix("http://").split(":")
    proxy = TcpProxy((host, int(port)))
    log = open(tmp_path / "cut.log", "w+b")
    # The production backoff (retries after 2-20 s), so the run can ride out the 20 s.
    proc = _spawn(INGEST, catalogue, store, env={"AWS_ENDPOINT_URL": proxy.url, "IMGEST_RETRY_BACKOFF_S": "2"},
                  log=log)
    try:
        assert _wait(lambda: bool(_markers(s3, bucket)), 120, proc), "no shard committed before the cut"
        proxy.cut()
        time.sleep(20)
        proxy.restore()
        proc.wait(timeout=300)
    finally:
        proxy.cut()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    ingest_into(catalogue, store, model=MODEL, batch_size="4", shard_size=10)
    assert live_rows(store, MODEL) == _reference(s3, catalogue)
    _no_secret(log)
    log.seek(0)
    figures["endpoint cut 20 s mid-ingest"] = {
        "faults": 1, "run outcome": "finished (retries)" if proc.returncode == 0 else "failed cleanly, rerun resumed",
        "items lost": 0, "duplicates": 0}


def test_a_paused_lock_holder_cannot_commit_over_its_successor(s3, figures, tmp_path, monkeypatch):
    bucket = _bucket(s3, "pause")
    catalogue, store = f"s3://{bucket}/cat", f"s3://{bucket}/store"
    _put_images(s3, bucket, range(60))
    monkeypatch.setenv("IMGEST_LOCK_TTL", "3")
    log = open(tmp_path / "paused.log", "w+b")
    proc = _spawn(INGEST, catalogue, store, env={"IMGEST_LOCK_TTL": "3"}, log=log)
    try:
        assert _wait(lambda: bool(_markers(s3, bucket)), 120, proc), "no shard committed before the pause"
        os.killpg(proc.pid, signal.SIGSTOP)  # SIGSTOP: every thread of it, the heartbeat too
        time.sleep(4.5)  # past the heartbeat window
        _put_images(s3, bucket, range(60, 64))
        second = ingest_into(catalogue, store, model=MODEL, batch_size="4", shard_size=10)
        assert second["snapshot_seq"] >= 1
        os.killpg(proc.pid, signal.SIGCONT)
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log.seek(0)
    output = log.read().decode(errors="replace")
    assert proc.returncode != 0 and "lost the writer lock" in output, output[-3000:]
    ingest_into(catalogue, store, model=MODEL, batch_size="4", shard_size=10)
    assert live_rows(store, MODEL) == _reference(s3, catalogue)
    _no_secret(log)
    figures["lock holder paused past the heartbeat window"] = {
        "faults": 1, "paused run": "stopped at its next commit (LockLostError)", "items lost": 0, "duplicates": 0}


def test_two_ingests_started_together(s3, figures, tmp_path):
    bucket = _bucket(s3, "two")
    catalogue, store = f"s3://{bucket}/cat", f"s3://{bucket}/store"
    _put_images(s3, bucket, range(60))
    logs = [open(tmp_path / f"two-{n}.log", "w+b") for n in range(2)]
    go = tmp_path / "go"
    # Both import everything first, say they are ready, and start on the same signal: the race is for the lock.
    procs = [_spawn(STARTING_GUN + INGEST, catalogue, store, str(tmp_path / f"ready-{n}"), str(go), log=log)
             for n, log in enumerate(logs)]
    assert _wait(lambda: all((tmp_path / f"ready-{n}").exists() for n in range(2)), 120)
    go.touch()
    codes = [p.wait(timeout=300) for p in procs]
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read().decode(errors="replace"))
    refused = [o for c, o in zip(codes, outputs) if c != 0]
    assert len(refused) <= 1 and all("locked by run" in o or "took the lock at the same moment" in o
                                     for o in refused), outputs
    if not refused:  # on a loaded machine the second may reach the lock only after the first let it go
        s3.invalidate_cache()
        runs = sorted((json.loads(s3.cat(p)) for p in s3.glob(f"{bucket}/store/runs/*.json")),
                      key=lambda r: r["started"])
        assert len(runs) == 2 and runs[0]["finished"] <= runs[1]["started"], "two holders at once"
        assert runs[1]["encoded"] == 0, "the second found nothing left to do"
    assert live_rows(store, MODEL) == _reference(s3, catalogue)
    _no_secret(*logs)
    figures["two ingests started together"] = {"faults": 1, "finished": codes.count(0),
                                               "refused (store locked)": len(refused),
                                               "serialised (one after the other)": not refused, "items lost": 0,
                                               "duplicates": 0}


BUILD = """
import sys
from imgest.flows.build_index import build_index
build_index(config=dict(store=sys.argv[1], model="raw-pixels", kind="hnsw", rebuild=True))
"""
PROMOTE = """
import sys
from imgest.flows.migrate import migrate
migrate(config=dict(store=sys.argv[1], action="promote", force="kill test: no evaluation"))
"""


def _serving_answers(store: str) -> str:
    searcher = Searcher(store, alias="serving")
    loc = Location(store)
    item = next(iter(load_state(loc, searcher.card["slug"]).live()))
    found = searcher.search([Query("q", image=item.uri)], k=3)[0]
    assert found and found[0].item_id == item.item_id
    return searcher.card["slug"]


def test_kills_during_build_index_and_during_promote(s3, figures, tmp_path, tiny_models):
    from imgest.flows.migrate import migrate
    from imgest.flows.nightly import nightly

    rng = random.Random(7)
    bucket = _bucket(s3, "index")
    catalogue, store = f"s3://{bucket}/cat", f"s3://{bucket}/store"
    _put_images(s3, bucket, range(40))
    nightly(NightlyConfig(catalogue=catalogue, store=store, model=MODEL, batch_size="4"))
    logs, kills = [], 0
    for round_ in range(2):
        log = open(tmp_path / f"build-{round_}.log", "w+b")
        logs.append(log)
        proc = _spawn(BUILD, store, log=log)
        _wait(lambda: len(generations(Location(store))) > 0, 60, proc)
        time.sleep(rng.uniform(0.5, 3.0))
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            kills += 1
        proc.wait()
        assert _serving_answers(store) == resolve(MODEL).slug  # a half-written version is never served
    built = build_index(IndexConfig(store=store, model=MODEL, kind="hnsw"))
    assert built["built"]

    new = f"hf:{tiny_models['dinov2']}"
    migrate(MigrateConfig(store=store, action="start", to=new, batch_size="4", catalogue=catalogue))
    log = open(tmp_path / "promote.log", "w+b")
    logs.append(log)
    proc = _spawn(PROMOTE, store, log=log)
    time.sleep(rng.uniform(1.0, 4.0))
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        kills += 1
    proc.wait()
    assert _serving_answers(store) in (resolve(MODEL).slug, resolve(new).slug)  # the old or the new, whole
    promoted = migrate(MigrateConfig(store=store, action="promote", force="kill test: no evaluation"))
    assert promoted["aliases"]["serving"]["slug"] == resolve(new).slug
    assert _serving_answers(store) == resolve(new).slug
    _no_secret(*logs)
    figures["kill -9 during build-index and promote"] = {"faults": 3, "kills landed": kills,
                                                         "serving answered after each": True, "items lost": 0}
