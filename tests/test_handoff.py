"""Decoded pixels through shared memory, and the cores split between decode and encoder by measured cost."""

from __future__ import annotations

import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from imgest import encoders
from imgest.images.decode import decode_image
from imgest.state.layout import shard_key
from imgest.state.shards import embedding_matrix
from imgest.storage import Location
from imgest.tasks.ingest import decode_workers, handoff
from imgest.tasks.ingest import encode as encode_module
from imgest.tasks.ingest.decode_workers import plan_decode
from imgest.tasks.ingest.encode import _prepare_in_process, encode_shard, prepare
from imgest.tasks.ingest.plan import ShardPlan, WorkItem
from tests.helpers import gradient, jpeg_bytes, png_bytes, write_files

RUN = "r00000001-20261202T000000-abcdef"


def _catalogue(root, n: int) -> tuple[Location, tuple[WorkItem, ...]]:
    files = {f"p/{i:03d}.jpg": jpeg_bytes(gradient(i, (700 + i, 560))) for i in range(n - 2)}
    files["p/cut-out.png"] = png_bytes(gradient(7, (600, 600)).convert("RGBA"))
    files["p/broken.jpg"] = b"\xff\xd8 not a jpeg"
    write_files(str(root), files)
    cat = Location(str(root))
    return cat, tuple(WorkItem(k, cat.uri(k), len(files[k]), 1.0, None, None) for k in sorted(files))


@pytest.mark.slow("real weights")
def test_a_decode_process_hands_back_a_slot_not_the_pixels(tmp_path):
    lite0 = encoders.load(encoders.resolve("efficientnet-lite0"), "cpu")
    cat, items = _catalogue(tmp_path / "cat", 4)
    by_id = {item.item_id: item for item in items}
    slots = handoff.PixelSlots(3, handoff.slot_bytes(lite0))
    try:
        done = _prepare_in_process(cat.url, (by_id["p/001.jpg"], None), 5, lite0.preprocess_fn, 10**8,
                                   lite0.decode_side, (slots.name, 3, slots.nbytes))
        assert done.pixels is None and done.slot == (5 % 3, (3, 224, 224), "|u1")
        expected = prepare(cat, by_id["p/001.jpg"], lite0.preprocess, 10**8, lite0.decode_side).pixels
        np.testing.assert_array_equal(slots.read(*done.slot), expected)
        broken = _prepare_in_process(cat.url, (by_id["p/broken.jpg"], None), 0, lite0.preprocess_fn, 10**8,
                                     lite0.decode_side, (slots.name, 3, slots.nbytes))
        assert broken.slot is None and broken.reason  # a rejection carries no pixels at all
    finally:
        slots.close()


def _shm_segments() -> set[str]:
    """Shared-memory blocks (a kept decode pool's semaphores live beside them, as sem.mp-*, until it ends)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("psm_")} if os.path.isdir("/dev/shm") else set()


@pytest.mark.slow("real weights")
def test_processes_and_threads_encode_the_same_shard_alike_and_the_block_is_freed(tmp_path):
    lite0 = encoders.load(encoders.resolve("efficientnet-lite0"), "cpu")
    cat, items = _catalogue(tmp_path / "cat", 80)
    before = _shm_segments()
    tables = {}
    for workers, kind in ((2, "process"), (1, "thread")):
        store = Location(str(tmp_path / f"store-{kind}"))
        if kind == "thread":  # fewer objects than PROCESS_MIN_ITEMS decode in threads: lower the bar instead
            decode_workers.PROCESS_MIN_ITEMS, old = 10**9, decode_workers.PROCESS_MIN_ITEMS
        try:
            result = encode_shard(ShardPlan(RUN, 0, items), lite0, cat, store, batch_size=8, decode_workers=workers)
        finally:
            if kind == "thread":
                decode_workers.PROCESS_MIN_ITEMS = old
        assert kind in result.decode and result.encoded == 79 and len(result.rejected) == 1
        tables[kind] = pq.read_table(store.path(shard_key(lite0.spec.slug, result.shard)))
    assert tables["process"].column("item_id").to_pylist() == tables["thread"].column("item_id").to_pylist()
    np.testing.assert_array_equal(embedding_matrix(tables["process"], 1280), embedding_matrix(tables["thread"], 1280))
    assert _shm_segments() <= before  # the shared block is unlinked when the shard ends


@pytest.mark.slow("real weights")
def test_the_cores_split_in_the_proportion_of_measured_costs(monkeypatch):
    lite0 = encoders.load(encoders.resolve("efficientnet-lite0"), "cpu")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    # decode 7 ms, encode 5 ms a picture: 16 x 7 / 12 = 9.3 -> 9 decode cores, 7 encoder threads; one more
    # decode process, all of them niced: they take what the encoder leaves idle
    plan = plan_decode(lite0, 0, 2000, False, costs=(0.007, 0.005))
    assert (plan.workers, plan.torch_threads, plan.processes, plan.nice) == (10, 7, True, decode_workers.DECODE_NICE)
    assert plan.describe() == "10 decode processes (nice 10), torch 7 thread(s)"
    assert plan_decode(lite0, 0, 2000, False, costs=(0.05, 0.0001)).torch_threads == 1  # one core stays the encoder's
    # a decode under half a core's share (a ViT's: 8 ms against 240): the encoder keeps every core, and the niced
    # decode processes take what it leaves idle (on 2 cores: 0.52 of the work bound with one encoder thread)
    assert plan_decode(lite0, 0, 2000, False, costs=(0.0001, 0.05)).torch_threads == 16
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    vit = plan_decode(lite0, 0, 2000, False, costs=(0.008, 0.24))
    assert (vit.workers, vit.torch_threads, vit.nice) == (2, 2, decode_workers.DECODE_NICE)
    assert plan_decode(lite0, 0, 20, False, costs=(0.008, 0.24)).torch_threads == 1  # decode threads: not niced
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert plan_decode(lite0, 0, 2000, False).torch_threads == 8  # nothing measured: half each
    assert plan_decode(lite0, 0, 20, False).nice == 0  # decode threads are not niced (nor outnumber)
    assert (plan_decode(lite0, 4, 2000, False, costs=(0.007, 0.005)).workers, plan.nice) == (4, 10)  # N wins
    assert plan_decode(lite0, 4, 2000, False).nice == 0


@pytest.mark.slow("real weights")
def test_the_decode_cost_is_measured_on_what_will_be_read(tmp_path):
    lite0 = encoders.load(encoders.resolve("efficientnet-lite0"), "cpu")
    cat, items = _catalogue(tmp_path / "cat", 10)
    cost = encode_module.decode_cost(cat, items, lite0, 10**8)
    assert 0 < cost.seconds < 1.0  # core-seconds per decoded picture: the broken one counts for nothing
    assert cost.seconds >= cost.measured[cost.decoder] == min(cost.measured.values())  # reading counts on top
    broken = tuple(item for item in items if item.item_id == "p/broken.jpg")
    assert encode_module.decode_cost(cat, broken, lite0, 10**8) is None  # only the broken one: no figure
    assert decode_image(jpeg_bytes(gradient(1, (700, 560))), min_side=256).size == (350, 280)


def test_a_shared_memory_too_small_for_the_slots_is_refused_in_one_line(tmp_path):
    assert handoff.room(str(tmp_path)) > 0 and handoff.room(str(tmp_path / "absent")) is None  # nothing to check
    handoff.check_room(2049, 150_528, free=2**30)  # Lite0 at batch 1024 fits in 1 GB
    with pytest.raises(handoff.SharedMemoryError) as refused:
        handoff.check_room(2049, 150_528, free=64 * 2**20)  # a container's default /dev/shm
    message = str(refused.value)
    assert "\n" not in message and "64 MB free" in message and "368 MB" in message and "--shm-size" in message
    handoff.check_room(2049, 150_528, path=str(tmp_path / "absent"))  # no /dev/shm here (not Linux): no check


def test_a_shard_is_refused_before_anything_is_read_when_its_slots_do_not_fit(tmp_path, monkeypatch):
    raw = encoders.load(encoders.resolve("raw-pixels"), "cpu")
    raw.preprocess_fn = raw.preprocess  # decodes in processes, as a model with a decode-process path does
    cat, items = _catalogue(tmp_path / "cat", decode_workers.PROCESS_MIN_ITEMS + 2)
    read = []
    monkeypatch.setattr(Location, "read_bytes", lambda self, key: read.append(key))
    need = (max(2 * 64, 4 * 3, 32) + 1) * handoff.slot_bytes(raw)  # raw pixels: 48 bytes a slot
    monkeypatch.setattr(handoff, "room", lambda path=handoff.SHM: need // 2)  # a /dev/shm with half of it free
    with pytest.raises(handoff.SharedMemoryError, match="pixel slots need"):
        encode_shard(ShardPlan(RUN, 0, items), raw, cat, Location(str(tmp_path / "store")), batch_size=64,
                     decode_workers=2)
    assert read == [] and not (tmp_path / "store").exists()
