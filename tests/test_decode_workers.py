"""Decode processes kept from one shard to the next: reused for the same plan and environment, never after a
failure or a change of credentials, ended when idle, and a kept process killed meanwhile costs no object."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest

from imgest.state.layout import shard_key
from imgest.state.shards import embedding_matrix
from imgest.storage import Location
from imgest.tasks.ingest import decode_workers
from imgest.tasks.ingest.encode import encode_shard
from imgest.tasks.ingest.plan import ShardPlan, WorkItem
from tests.helpers import gradient, ingest_into, jpeg_bytes, write_files

RUN = "r00000001-20261205T000000-abcdef"



def _catalogue(root, n: int = 70) -> tuple[Location, tuple[WorkItem, ...]]:
    files = {f"p/{i:03d}.jpg": jpeg_bytes(gradient(i, (500 + i, 400))) for i in range(n - 1)}
    files["p/broken.jpg"] = b"\xff\xd8 not a jpeg"
    write_files(str(root), files)
    cat = Location(str(root))
    return cat, tuple(WorkItem(k, cat.uri(k), len(files[k]), 1.0, None, None) for k in sorted(files))


def _decode_processes() -> set[int]:
    """This process's spawned children (decode processes; Python's resource tracker is not spawned so)."""
    found: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/self/task/{task}/children") as fh:
            found |= {int(p) for p in fh.read().split()}
    alive = set()
    for pid in found:
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/cmdline", "rb") as fh:
            if b"spawn_main" in fh.read():
                alive.add(pid)
    return alive


def _settled(count: int, deadline_s: float = 30.0) -> set[int]:
    """The decode processes once `count` are left: another test's kept ones may still be ending."""
    deadline = time.monotonic() + deadline_s
    while (found := _decode_processes()) and len(found) != count and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def _shard(lite0, cat, items, store, number: int = 0, encoder=None):
    return encode_shard(ShardPlan(RUN, number, items), encoder or lite0, cat, store, batch_size=8, decode_workers=2)


@pytest.mark.slow("decode processes")
def test_the_next_shard_decodes_on_the_processes_the_last_one_left(tmp_path, lite0):
    cat, items = _catalogue(tmp_path / "cat")
    first = _shard(lite0, cat, items, Location(str(tmp_path / "a")))
    assert first.decode == "2 decode processes" and first.encoded == 69
    left = _settled(2)
    assert len(left) == 2
    second = _shard(lite0, cat, items, Location(str(tmp_path / "b")), 1)
    assert second.decode == "2 decode processes, kept from the shard before"
    assert _decode_processes() == left  # the same two, no new ones
    assert (second.encoded, [i for i, _ in second.rejected]) == (69, ["p/broken.jpg"])
    tables = [pq.read_table(Location(str(tmp_path / d)).path(shard_key(lite0.spec.slug, r.shard)))
              for d, r in (("a", first), ("b", second))]
    assert tables[0].column("item_id").to_pylist() == tables[1].column("item_id").to_pylist()
    np.testing.assert_array_equal(embedding_matrix(tables[0], 1280), embedding_matrix(tables[1], 1280))


@pytest.mark.slow("decode processes")
def test_a_changed_environment_gets_new_processes(tmp_path, lite0, monkeypatch):
    """Decode processes read the catalogue with the credentials they inherited: new ones see new ones."""
    cat, items = _catalogue(tmp_path / "cat")
    _shard(lite0, cat, items, Location(str(tmp_path / "a")))
    before = _settled(2)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "rotated")
    second = _shard(lite0, cat, items, Location(str(tmp_path / "b")), 1)
    assert second.decode == "2 decode processes" and second.encoded == 69
    assert not _settled(2) & before


@pytest.mark.slow("decode processes")
def test_a_failed_shard_keeps_nothing(tmp_path, lite0):
    cat, items = _catalogue(tmp_path / "cat")

    def refuse(batch):
        raise RuntimeError("the encoder failed")

    failing = SimpleNamespace(spec=lite0.spec, device="cpu", decode_side=lite0.decode_side,
                              preprocess=lite0.preprocess, preprocess_fn=lite0.preprocess_fn, encode_images=refuse,
                              runtime="torch", precision="fp32")
    with pytest.raises(RuntimeError, match="the encoder failed"):
        _shard(lite0, cat, items, Location(str(tmp_path / "a")), encoder=failing)
    assert not _settled(0)  # stopped with the shard
    after = _shard(lite0, cat, items, Location(str(tmp_path / "b")), 1)
    assert after.decode == "2 decode processes" and after.encoded == 69


@pytest.mark.slow("decode processes")
def test_kept_processes_end_when_no_shard_comes(tmp_path, lite0, monkeypatch):
    monkeypatch.setattr(decode_workers, "KEEP_IDLE_SECONDS", 0.5)
    cat, items = _catalogue(tmp_path / "cat")
    _shard(lite0, cat, items, Location(str(tmp_path / "a")))
    assert not _settled(0)
    assert _shard(lite0, cat, items, Location(str(tmp_path / "b")), 1).decode == "2 decode processes"


@pytest.mark.slow("decode processes")
def test_a_kept_process_killed_while_idle_costs_no_object(tmp_path, lite0):
    cat, items = _catalogue(tmp_path / "cat")
    _shard(lite0, cat, items, Location(str(tmp_path / "a")))
    for pid in _settled(2):
        os.kill(pid, signal.SIGKILL)
    second = _shard(lite0, cat, items, Location(str(tmp_path / "b")), 1)
    assert (second.encoded, [i for i, _ in second.rejected]) == (69, ["p/broken.jpg"])


@pytest.mark.slow("decode processes")
def test_an_ingest_runs_its_shards_on_the_same_decode_processes(prefect_harness, tmp_path):
    """Through Prefect (the shards are tasks of one flow run): every shard after the first decodes on the
    processes the one before left, the run's shard timeline says so, and they end with the run's last shard."""
    from tests.helpers import small_catalogue

    cat, store = tmp_path / "catalogue", tmp_path / "store"
    write_files(str(cat), small_catalogue(210))
    summary = ingest_into(cat, store, runtime="torch", precision="fp32", batch_size="8", shard_size=70,
                          decode_workers=2)
    assert summary["encoded"] == 210
    timeline = pq.read_table(store / "runs" / f"{summary['run_id']}.shards.parquet").sort_by("started")
    assert timeline.column("decode").to_pylist() == ["2 decode processes"] + \
        ["2 decode processes, kept from the shard before"] * 2
    assert not _settled(0, 10)  # ended with the run's last shard, not a minute later
