"""encode_shard, the shard writer and the run summary, called directly (no Prefect, no server): the raw-pixel
encoder on small real PNG and JPEG files, so every vector can be recomputed by hand."""

from __future__ import annotations

import hashlib
import json
import os
from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow.parquet as pq
import pytest

from imgest import encoders
from imgest.images.decode import decode_image
from imgest.state.committed import LIVE, REJECTED, CatalogueState, ItemState, load_state, prepare_state
from imgest.state.layout import commit_key, shard_key
from imgest.state.shards import embedding_matrix
from imgest.storage import TEMP_PREFIX, Location
from imgest.tasks.ingest.commit import commit_run, new_summary
from imgest.tasks.ingest.encode import encode_shard
from imgest.tasks.ingest.plan import Plan, ShardPlan, WorkItem
from imgest.tasks.ingest.writer import ShardWriter
from tests.helpers import gradient, jpeg_bytes, png_bytes, write_files

RUN = "r00000001-20261130T000000-abcdef"


class RecordingLocation(Location):
    """A local Location that remembers the order in which keys were written."""

    def __init__(self, url: str):
        super().__init__(url)
        self.written: list[str] = []

    def write_bytes(self, key: str, data: bytes) -> None:
        super().write_bytes(key, data)
        self.written.append(key)


def _item(item_id: str, root, prev_hash: str | None = None) -> WorkItem:
    return WorkItem(item_id=item_id, uri=f"{root}/{item_id}", size=1, mtime=1.0, etag=None, prev_hash=prev_hash)


@pytest.fixture
def pixels():
    return encoders.load(encoders.resolve("raw-pixels"), "cpu")


@pytest.fixture
def catalogue(tmp_path):
    files = {"a.png": png_bytes(gradient(1)), "b.jpg": jpeg_bytes(gradient(2, (80, 40))),
             "c.png": png_bytes(gradient(3)), "bad.jpg": b"\xff\xd8 not really a jpeg",
             "same.png": png_bytes(gradient(4))}
    write_files(str(tmp_path / "cat"), files)
    return tmp_path / "cat", files


def test_encode_shard_encodes_rejects_skips_and_writes_the_marker_last(tmp_path, pixels, catalogue):
    root, files = catalogue
    same_hash = hashlib.sha256(files["same.png"]).hexdigest()
    items = (_item("a.png", root), _item("bad.jpg", root), _item("b.jpg", root), _item("gone.png", root),
             _item("same.png", root, prev_hash=same_hash), _item("c.png", root))
    plan = ShardPlan(RUN, 7, items)
    store = RecordingLocation(str(tmp_path / "store"))

    result = encode_shard(plan, pixels, Location(str(root)), store, batch_size=2, decode_workers=2)

    assert (result.shard, result.encoded, result.unchanged, result.vanished) == (plan.name, 3, 1, 1)
    assert [i for i, _ in result.rejected] == ["bad.jpg"] and "UnidentifiedImageError" in result.rejected[0][1]
    table = pq.read_table(store.path(shard_key(pixels.spec.slug, plan.name)))
    assert table.column("item_id").to_pylist() == ["a.png", "b.jpg", "c.png"]  # plan order, across batches of 2
    expected = pixels.encode_images(np.stack([pixels.preprocess(decode_image(files[k], min_side=pixels.decode_side))
                                              for k in ("a.png", "b.jpg", "c.png")]))
    np.testing.assert_allclose(embedding_matrix(table, pixels.spec.dim), expected, rtol=1e-6, atol=1e-6)
    assert table.column("content_hash").to_pylist() == [hashlib.sha256(files[k]).hexdigest()
                                                        for k in ("a.png", "b.jpg", "c.png")]
    meta = {k.decode(): v.decode() for k, v in table.schema.metadata.items()}
    assert meta["imgest.model_id"] == pixels.spec.model_id and meta["imgest.rows"] == "3"
    data = open(store.path(shard_key(pixels.spec.slug, plan.name)), "rb").read()
    assert result.sha256 == hashlib.sha256(data).hexdigest() and result.bytes == len(data)
    # the shard file is durable before the marker that makes it count
    assert store.written == [shard_key(pixels.spec.slug, plan.name), commit_key(pixels.spec.slug, plan.name)]
    marker = store.read_json(commit_key(pixels.spec.slug, plan.name))
    assert [r["item_id"] for r in marker["encoded"]] == ["a.png", "b.jpg", "c.png"]
    assert [r["item_id"] for r in marker["rejected"]] == ["bad.jpg"]
    assert [r["item_id"] for r in marker["unchanged"]] == ["same.png"]
    assert result.worker and result.started <= result.finished


def test_writer_refuses_a_wrong_shape_and_commits_an_empty_shard_without_a_file(tmp_path, pixels, catalogue):
    root, _ = catalogue
    store = RecordingLocation(str(tmp_path / "store"))
    plan = ShardPlan(RUN, 0, (_item("a.png", root),))
    writer = ShardWriter(store, pixels.spec, plan)
    with pytest.raises(ValueError, match=r"encoder returned \(1, 5\), expected \(1, 768\)"):
        writer.add([(plan.items[0], "h")], np.zeros((1, 5), np.float32))
    writer.reject(plan.items[0], "h", "DecodeError: truncated")
    result = writer.flush()
    assert result.encoded == 0 and result.sha256 is None
    assert store.written == [commit_key(pixels.spec.slug, plan.name)]  # a marker, no Parquet file
    marker = store.read_json(commit_key(pixels.spec.slug, plan.name))
    assert marker["file"] is None and marker["rejected"][0]["reason"] == "DecodeError: truncated"


def test_run_summary_counts_the_commit_and_times_runs_longer_than_a_day(tmp_path, pixels, catalogue):
    root, _ = catalogue
    store = Location(str(tmp_path / "store"))
    items = (_item("a.png", root), _item("bad.jpg", root), _item("b.jpg", root))
    plan = Plan(run_id=RUN, listed=4, skipped=1, new=3, deleted=["old.png"], shards=[ShardPlan(RUN, 0, items)])
    state = CatalogueState(slug=pixels.spec.slug, items={})
    state.items["old.png"] = ItemState("old.png", f"{root}/old.png", LIVE, None, 1, 1.0, "h0", "part-x-00000")
    result = encode_shard(plan.shards[0], pixels, Location(str(root)), store, batch_size=4)
    summary = new_summary(pixels.spec, RUN, str(root), str(tmp_path / "store"), {"batch_size": "4"})
    summary.started = (datetime.now(UTC) - timedelta(days=1, hours=1)).isoformat(timespec="seconds")
    summary.device = "cpu"

    summary = commit_run(store, state, plan, [result], summary)

    # listed 4, skipped 1 (not an image), 3 new read: 2 encoded, 1 rejected; old.png deleted
    assert (summary.listed, summary.skipped, summary.new, summary.encoded, summary.rejected, summary.deleted) == \
        (4, 1, 3, 2, 1, 1)
    assert summary.shards == 1 and summary.snapshot_seq == 1 and summary.gpu_hours == 0.0
    assert 25 * 3600 <= summary.seconds < 25 * 3600 + 120  # a day and an hour, not just the hour
    assert summary.images_per_second == round(2 / summary.encode_seconds, 2)
    saved = json.loads(open(store.path(f"runs/{RUN}.json")).read())
    assert saved["encoded"] == 2 and saved["rejected_items"][0][0] == "bad.jpg"
    timeline = pq.read_table(store.path(f"runs/{RUN}.shards.parquet"))
    assert timeline.column("shard").to_pylist() == [plan.shards[0].name]
    state = load_state(store, pixels.spec.slug)
    assert {k: v.status for k, v in state.items.items()} == \
        {"a.png": LIVE, "b.jpg": LIVE, "bad.jpg": REJECTED, "old.png": "deleted"}


def test_a_write_killed_before_its_rename_is_ignored_then_swept(tmp_path, pixels, catalogue):
    """kill -9 between a marker's temp file and its rename (seen in CI): the hidden temp file is not a
    commit, loading the state skips it, and the next writer's sweep deletes it."""
    root, _ = catalogue
    store = Location(str(tmp_path / "store"))
    plan = ShardPlan(RUN, 0, (_item("a.png", root),))
    encode_shard(plan, pixels, Location(str(root)), store, batch_size=4)
    slug = pixels.spec.slug
    marker = store.path(commit_key(slug, plan.name))
    commits = os.path.dirname(marker)
    killed = {os.path.join(commits, f"{TEMP_PREFIX}0123abcd-part-{RUN}-00001.json"): b'{"half',
              store.path(shard_key(slug, f"{TEMP_PREFIX}4567-part-{RUN}-00001")): b"PAR1"}
    for path, data in killed.items():
        with open(path, "wb") as fh:
            fh.write(data)

    assert store.list_names(f"state/model={slug}/commits") == [f"part-{RUN}-00000.json"]
    state, removed = prepare_state(store, pixels.spec.describe())
    assert state.pending == [plan.name] and set(state.items) == {"a.png"}
    assert removed == [os.path.basename(p) for p in killed if "embeddings" in p]
    assert not [p for p in killed if os.path.exists(p)] and os.path.exists(marker)


@pytest.mark.slow("real weights")
def test_decode_processes_write_the_shard_threads_write(tmp_path, monkeypatch):
    """A shard big enough decodes in processes (spawned, the catalogue passed by URL): same rows, same
    vectors, same rejects as decode threads; a small one stays on threads."""
    import imgest.tasks.ingest.decode_workers as decode_workers

    lite0 = encoders.load(encoders.resolve("efficientnet-lite0"), "cpu")
    files = {f"p/{i:03d}.jpg": jpeg_bytes(gradient(i, (300, 200))) for i in range(70)}
    files["p/bad.jpg"] = b"\xff\xd8 not really a jpeg"
    write_files(str(tmp_path / "cat"), files)
    cat = Location(str(tmp_path / "cat"))
    items = tuple(_item(k, tmp_path / "cat") for k in sorted(files))
    tables, results = [], []
    for name, minimum in (("processes", decode_workers.PROCESS_MIN_ITEMS), ("threads", 10**9)):
        monkeypatch.setattr(decode_workers, "PROCESS_MIN_ITEMS", minimum)
        store = Location(str(tmp_path / name))
        result = encode_shard(ShardPlan(RUN, 0, items), lite0, cat, store, batch_size=16, decode_workers=2)
        tables.append(pq.read_table(store.path(shard_key(lite0.spec.slug, result.shard))))
        results.append(result)
    assert results[0].decode == "2 decode processes" and results[1].decode == "2 decode threads"
    assert results[0].rejected == results[1].rejected and [i for i, _ in results[0].rejected] == ["p/bad.jpg"]
    assert tables[0].column("item_id").to_pylist() == tables[1].column("item_id").to_pylist()
    np.testing.assert_array_equal(embedding_matrix(tables[0], 1280), embedding_matrix(tables[1], 1280))

    monkeypatch.undo()
    auto = decode_workers.plan_decode(lite0, 0, 1000, gpu_jpeg=False)
    cores = len(os.sched_getaffinity(0))
    share = max(1, cores // 2)  # nothing measured: half the cores each, and one niced decoder more beside them
    assert auto.torch_threads == max(1, cores - share) and auto.workers == share + (cores > 1)
    assert auto.processes and not decode_workers.plan_decode(lite0, 0, 10, gpu_jpeg=False).processes


KILLED_ENCODER = """
import sys
from imgest import encoders
from imgest.storage import Location
from imgest.tasks.ingest.encode import encode_shard
from imgest.tasks.ingest.plan import ShardPlan, WorkItem
cat = Location(sys.argv[1])
keys = sorted(o.key for o in cat.walk())
items = tuple(WorkItem(k, cat.uri(k), 1, None, None, None) for k in keys)
lite0 = encoders.load(encoders.resolve("efficientnet-lite0"), "cpu")
encode_shard(ShardPlan("r00000001-20261130T000000-abcdef", 0, items), lite0, cat, Location(sys.argv[2]), 1,
             decode_workers=2)
"""


@pytest.mark.slow("a subprocess")
def test_decode_processes_end_when_their_encoder_is_killed(tmp_path):
    """kill -9 of the process encoding a shard leaves no decode process behind waiting for work."""
    import signal
    import subprocess
    import sys
    import time

    write_files(str(tmp_path / "cat"), {f"p/{i:03d}.jpg": jpeg_bytes(gradient(i, (900, 700))) for i in range(400)})
    proc = subprocess.Popen([sys.executable, "-c", KILLED_ENCODER, str(tmp_path / "cat"), str(tmp_path / "store")])

    def children() -> list[int]:
        found = []
        for task in os.listdir(f"/proc/{proc.pid}/task"):
            with open(f"/proc/{proc.pid}/task/{task}/children") as fh:
                found += [int(p) for p in fh.read().split()]
        return found

    # Waits on real processes (no timed logic here): polled often, bounded by a deadline.
    deadline = time.monotonic() + 120
    workers: list[int] = []
    while time.monotonic() < deadline and len(workers) < 2:
        assert proc.poll() is None, "the encoder ended before its decode processes started"
        workers = [p for p in children() if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
        time.sleep(0.02)
    assert len(workers) == 2, workers
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    def running(pid: int) -> bool:  # a zombie has ended: only its reaping is left
        try:
            with open(f"/proc/{pid}/stat") as fh:
                return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(running(p) for p in workers):
        time.sleep(0.02)
    alive = [p for p in workers if running(p)]
    assert not alive, f"decode processes {alive} outlived their encoder"


@pytest.mark.slow("real weights")
def test_a_decode_process_that_dies_costs_its_object_only(tmp_path):
    """One image kills its decode process: it is retried alone, rejected with the reason, and every other
    object of the shard is encoded by new decode processes."""
    from types import SimpleNamespace

    from tests.helpers import preprocess_or_die

    lite0 = encoders.load(encoders.resolve("efficientnet-lite0"), "cpu")
    dying = SimpleNamespace(spec=lite0.spec, device="cpu", decode_side=lite0.decode_side, preprocess=lite0.preprocess,
                            preprocess_fn=preprocess_or_die, encode_images=lite0.encode_images, runtime="torch",
                            precision="fp32")
    files = {f"p/{i:03d}.jpg": jpeg_bytes(gradient(i, (300, 200))) for i in range(70)}
    files["p/030-killer.jpg"] = jpeg_bytes(gradient(999, (301, 201)))
    write_files(str(tmp_path / "cat"), files)
    cat = Location(str(tmp_path / "cat"))
    items = tuple(_item(k, tmp_path / "cat") for k in sorted(files))
    result = encode_shard(ShardPlan(RUN, 0, items), dying, cat, Location(str(tmp_path / "store")), batch_size=16,
                          decode_workers=2)
    assert result.decode == "2 decode processes" and result.encoded == 70
    assert [(i, r.startswith("the decode process died on this object")) for i, r in result.rejected] == \
        [("p/030-killer.jpg", True)]
