"""Listing recognises images by extension and odd keys; planning sorts new/changed/unchanged/deleted."""

import os

from imgest.images.listing import Listing, is_image_key, list_catalogue, listing_table
from imgest.state.committed import DELETED, LIVE, REJECTED, CatalogueState, ItemState
from imgest.storage import Location, ObjectInfo
from imgest.tasks.ingest import plan as plan_module
from imgest.tasks.ingest.plan import plan_ingest
from tests.helpers import jpeg_bytes, solid, write_files

ODD_KEYS = ["with space.jpg", "ünïcode/ß.png", "hash#tag.JPG", "what?.jpeg", "plus+sign.Png"]


def test_extensions_case_insensitive_and_junk_skipped(tmp_path):
    files = {k: jpeg_bytes(solid((1, 2, 3))) for k in ODD_KEYS}
    files.update({"README.txt": b"x", ".DS_Store": b"x", "_SUCCESS": b"", "sub/notes.md": b"x"})
    write_files(str(tmp_path), files)
    listing = list_catalogue(str(tmp_path))
    assert sorted(o.key for o in listing.objects) == sorted(ODD_KEYS)
    assert listing.skipped == 4
    assert not is_image_key("photo.jpg.txt") and is_image_key("A.TIFF")


def test_file_url_and_plain_path_list_the_same(tmp_path):
    write_files(str(tmp_path), {"a/b.jpg": b"1"})
    assert [o.key for o in list_catalogue(f"file://{tmp_path}").objects] == ["a/b.jpg"]
    assert [o.key for o in list_catalogue(str(tmp_path)).objects] == ["a/b.jpg"]


def _state(**items) -> CatalogueState:
    return CatalogueState(slug="m", items={k: v for k, v in items.items()})


def _item(key, status=LIVE, size=1, mtime=1.0, etag=None, h="h"):
    return ItemState(item_id=key, uri=key, status=status, etag=etag, size=size, mtime=mtime, content_hash=h)


def test_plan_classifies_by_signature(tmp_path):
    write_files(str(tmp_path), {k: b"x" for k in ("same.jpg", "touched.jpg", "new.jpg", "back.jpg", "bad.jpg")})
    listing = list_catalogue(str(tmp_path))
    info = {o.key: o for o in listing.objects}
    state = _state(**{
        "same.jpg": _item("same.jpg", size=1, mtime=info["same.jpg"].mtime),
        "touched.jpg": _item("touched.jpg", size=1, mtime=0.5, h="old"),
        "gone.jpg": _item("gone.jpg"),
        "back.jpg": _item("back.jpg", status=DELETED),
        "bad.jpg": _item("bad.jpg", status=REJECTED, size=1, mtime=info["bad.jpg"].mtime),
        "old-tombstone.jpg": _item("old-tombstone.jpg", status=DELETED),
    })
    plan = plan_ingest(listing, state, "r00000002-x-y", shard_size=2)
    assert plan.unchanged == 2  # same.jpg, and bad.jpg stays rejected until it changes
    assert plan.new == 2  # new.jpg, and back.jpg which had been deleted
    assert plan.changed_candidates == 1
    assert plan.deleted == ["gone.jpg"]
    to_read = [w.item_id for s in plan.shards for w in s.items]
    assert sorted(to_read) == ["back.jpg", "new.jpg", "touched.jpg"]
    assert [len(s.items) for s in plan.shards] == [2, 1]
    assert {w.item_id: w.prev_hash for s in plan.shards for w in s.items}["touched.jpg"] == "old"
    assert plan.shards[1].name == "part-r00000002-x-y-00001"


def test_etag_decides_when_both_sides_have_one():
    listing = Listing("file:///cat", listing_table([ObjectInfo("a.jpg", 1, 5.0, "e1")]))
    same = plan_ingest(listing, _state(**{"a.jpg": _item("a.jpg", size=1, mtime=0.0, etag="e1")}), "r1", 10)
    moved = plan_ingest(listing, _state(**{"a.jpg": _item("a.jpg", size=1, mtime=5.0, etag="e0")}), "r1", 10)
    no_etag = plan_ingest(listing, _state(**{"a.jpg": _item("a.jpg", size=1, mtime=5.0, etag="")}), "r1", 10)
    assert same.unchanged == 1 and moved.changed_candidates == 1 and no_etag.unchanged == 1


def test_columnar_plan_from_parquet_files_follows_the_change(tmp_path, monkeypatch):
    """10,000 items: 1% changed, 0.5% new, 0.5% deleted, some failed, rejected and tombstoned; the plan from
    Parquet files on disk (what a large catalogue uses) equals the in-memory one and the change made, and so
    does the plan made in seven hash partitions."""
    import random

    import pyarrow.parquet as pq

    rng = random.Random(3)
    keys = [f"k/{i:06d}.jpg" for i in range(10_000)]
    state = _state(**{k: _item(k, size=10, mtime=1.0, etag=f"e-{k}") for k in keys})
    picked = rng.sample(keys, 300)
    changed, deleted, failed, rejected = picked[:100], picked[100:150], picked[150:200], picked[200:300]
    for k in failed:
        state.items[k].status = "failed"
    for k in rejected:
        state.items[k].status = REJECTED
    new = [f"k/new-{i:04d}.jpg" for i in range(50)]
    objects = [ObjectInfo(k, 10, 1.0, f"e-{k}" + ("x" if k in changed else "")) for k in keys if k not in deleted]
    objects += [ObjectInfo(k, 10, 2.0, "e-new") for k in new]
    listing = Listing("file:///cat", listing_table(sorted(objects, key=lambda o: o.key)))
    pq.write_table(listing.table, tmp_path / "listing.parquet")
    pq.write_table(state.to_table(), tmp_path / "state.parquet")

    plans = [plan_ingest(listing, state, "r00000002-x-y", 64),
             plan_ingest(listing, str(tmp_path / "state.parquet"), "r00000002-x-y", 64,
                         listing_source=str(tmp_path / "listing.parquet"))]
    # a catalogue past what one DuckDB join holds under its cap is planned in hash partitions, one pass each
    monkeypatch.setattr(plan_module, "PLAN_PARTITION_ROWS", 1_500)
    plans.append(plan_ingest(listing, str(tmp_path / "state.parquet"), "r00000002-x-y", 64,
                             listing_source=str(tmp_path / "listing.parquet")))
    for plan in plans:
        assert (plan.listed, plan.new, plan.changed_candidates, plan.retried) == (9_950 + 50, 50, 100, 50)
        assert plan.unchanged == plan.listed - 200 and plan.deleted == sorted(deleted)
        read = [w.item_id for s in plan.shards for w in s.items]
        assert read == sorted(changed + failed + new), "in key order, each once"
    assert plans[0].shards == plans[1].shards == plans[2].shards


def test_an_empty_listing_over_a_large_state_is_refused_from_counts_not_a_list_of_its_items(tmp_path):
    """The mass-delete check counts the unlisted live items in DuckDB before any id comes back to Python: an
    empty listing (a wrong prefix) over 200,000 live items is refused holding a few kB, where collecting the
    items it would tombstone took a tuple per item."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    import pytest

    from imgest.state.rows import STATE_SCHEMA
    from imgest.tasks.ingest.plan import MassDeleteError
    from tests.helpers import traced

    n = 200_000
    ids = pc.binary_join_element_wise("k/", pa.array(np.char.zfill(np.arange(n).astype(str), 7)), ".jpg", "")
    pq.write_table(pa.table({"item_id": ids, "uri": ids, "status": pa.array(["live"] * n), "etag": pa.nulls(n),
                             "size": pa.array(np.ones(n, np.int64)), "mtime": pa.array(np.ones(n)),
                             "content_hash": ids, "shard": pa.array(["part-0"] * n), "run_id": pa.array(["r"] * n),
                             "reason": pa.nulls(n), "updated_at": pa.array(["t"] * n)}).cast(STATE_SCHEMA),
                   tmp_path / "state.parquet")
    empty = Listing("file:///cat", listing_table([]))

    def refused():
        with pytest.raises(MassDeleteError, match=f"tombstone {n} of {n} live items.*from an empty listing"):
            plan_ingest(empty, str(tmp_path / "state.parquet"), "r00000002-x-y", max_delete_fraction=0.1)

    _, peak = traced(refused)
    assert peak < 2_000_000, f"the refusal traced {peak / 1e6:.1f} MB"


def test_location_atomic_write_and_exclusive_create(tmp_path):
    loc = Location(str(tmp_path))
    loc.write_bytes("a/b.bin", b"one")
    loc.write_bytes("a/b.bin", b"two")
    assert loc.read_bytes("a/b.bin") == b"two"
    assert not [n for n in os.listdir(tmp_path / "a") if n.startswith(".tmp-")]
    assert loc.create_exclusive("lock", b"1") and not loc.create_exclusive("lock", b"2")
    assert loc.read_bytes("lock") == b"1"


def test_redact_hides_credentials(monkeypatch):
    from imgest.storage import redact

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "imgest-test-secret-never-logged")
    text = redact("s3://AKIA:topsecret@bucket/x failed with imgest-test-secret-never-logged")
    assert "topsecret" not in text and "imgest-test-secret-never-logged" not in text
    assert "bucket/x" in text


def test_a_listing_is_written_to_local_parquet_as_listed_and_its_folder_goes_with_it(tmp_path):
    """Listing never holds the catalogue in memory: each part is a Parquet file on local disk, a merged listing
    keeps its parts' files (and their folders) alive, and the planner joins them from disk."""
    import gc

    import pyarrow.parquet as pq

    from imgest.images.listing import merge_listings

    write_files(str(tmp_path / "cat"), {"a/1.jpg": b"1", "a/2.jpg": b"22", "b/3.jpg": b"333", "top.jpg": b"4"})
    parts = [list_catalogue(str(tmp_path / "cat"), folder, depth) for folder, depth in [("", 1), ("a", None),
                                                                                          ("b", None)]]
    assert all(p.table is None and len(p.files) == 1 for p in parts)
    assert pq.read_table(parts[1].files[0])["key"].to_pylist() == ["a/1.jpg", "a/2.jpg"]
    merged = merge_listings(parts)
    folders = [s.path for s in merged.spill]
    del parts
    gc.collect()
    assert len(merged) == 4 and merged.keys == ["a/1.jpg", "a/2.jpg", "b/3.jpg", "top.jpg"]
    plan = plan_ingest(merged, _state(**{"a/2.jpg": _item("a/2.jpg", size=2, mtime=os.path.getmtime(
        tmp_path / "cat/a/2.jpg"))}), "r00000002-x-y")
    assert plan.listed == 4 and plan.unchanged == 1
    assert [i.item_id for s in plan.shards for i in s.items] == ["a/1.jpg", "b/3.jpg", "top.jpg"]
    del merged
    gc.collect()
    assert not any(os.path.exists(f) for f in folders)


def test_the_parts_of_a_listing_are_listed_side_by_side_and_each_retried_on_its_own(tmp_path, monkeypatch):
    """Each top-level folder is listed in its own thread at once with the others (their first tries meet at a
    barrier, which one thread at a time would never reach), a part that fails once is listed again alone, and a
    final fault is not tried again."""
    import logging
    import threading

    import pytest

    from imgest import policy
    from imgest.errors import FinalError
    from imgest.tasks.ingest import steps

    # the retry's wait, not its length, is under test here
    monkeypatch.setitem(policy.IO_RETRIES, "retry_delay_seconds", lambda retries: [0.0] * retries)
    write_files(str(tmp_path / "cat"), {"a/1.jpg": b"1", "b/2.jpg": b"22", "c/3.jpg": b"333", "top.jpg": b"4"})
    together, calls, real = threading.Barrier(3), [], steps.list_catalogue

    def listing(url, folder, depth):
        calls.append(folder)
        if folder and calls.count(folder) == 1:
            together.wait(timeout=60)
            if folder == "b":
                raise OSError("connection reset")
        return real(url, folder, depth)

    monkeypatch.setattr(steps, "list_catalogue", listing)
    logger, said = logging.getLogger("test-listing"), []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger.addHandler(handler)
    merged = steps.list_side_by_side(str(tmp_path / "cat"), logger)
    assert merged.keys == ["a/1.jpg", "b/2.jpg", "c/3.jpg", "top.jpg"]
    assert sorted(calls) == ["", "a", "b", "b", "c"]
    assert said == ["listing b/ of the catalogue failed (OSError: connection reset); try 2 of 4 in 0.0 s"]

    def final(url, folder, depth):
        calls.append(folder)
        raise FinalError("the catalogue says stop")

    calls.clear()
    monkeypatch.setattr(steps, "list_catalogue", final)
    with pytest.raises(FinalError):
        steps.list_side_by_side(str(tmp_path / "cat"), logger)
    assert calls and len(calls) == len(set(calls)), calls  # no part tried twice
    logger.removeHandler(handler)
