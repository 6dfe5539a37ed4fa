"""Kept pixels: each image an ingest decodes leaves a reduced JPEG copy in a pixel file beside its shard, committed
with it (imgest/images/kept.py, imgest/state/pixels.py); a later model reads the copies instead of the catalogue
when its side fits and it passes the gate (tasks/ingest/kept.py). The fast lane covers the copy, the setting, the
pixel files and their refusals; the slow lane runs real ingests under Prefect: copies that follow the catalogue
through a night of changes and through kill -9, and re-encodes from copies against re-encodes from the originals
(real EfficientNet-Lite weights)."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image, JpegImagePlugin
from typer.testing import CliRunner

from imgest.cli import app
from imgest.images import kept
from imgest.state import pixels
from imgest.storage import Location
from imgest.tasks.ingest.encode import with_copies
from imgest.tasks.ingest.plan import WorkItem
from tests.helpers import gradient, ingest_into

SLUG, SOURCE = "m-0000aaaa", "m-1111bbbb"


# -- the copy --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size, side, factor, copy_size", [
    ((1000, 600), 256, 2, (500, 300)),  # 600 // 256 = 2: 300 stays >= 256
    ((600, 1000), 256, 2, (300, 500)),  # a portrait: the shorter side is the width
    ((767, 767), 256, 2, (384, 384)),  # 767 // 256 = 2 (not 3: 255 < 256); Pillow's reduce rounds 383.5 up
    ((768, 900), 256, 3, (256, 300)),  # 768 // 256 = 3: exactly 256
    ((511, 2000), 256, 1, (511, 2000)),  # shorter side under twice the side: kept as the decode made it
    ((300, 200), 256, 1, (300, 200)),  # smaller than the side: never enlarged
    ((40, 30), 32, 1, (40, 30)),
    ((4000, 3000), 320, 9, (445, 334)),  # 3000 // 320 = 9: 333.3 -> 334, still >= 320
])
def test_a_copy_keeps_the_whole_image_reduced_by_a_whole_factor_never_enlarged(size, side, factor, copy_size):
    image = gradient(5, size)
    assert kept.reduction(size, side) == factor
    data, width, height = kept.make_copy(image, side)
    assert (width, height) == copy_size
    decoded = Image.open(io.BytesIO(data))
    assert decoded.format == "JPEG" and decoded.size == copy_size and decoded.mode == "RGB"
    assert JpegImagePlugin.get_sampling(decoded) == 0  # 4:4:4: full chroma
    assert abs(width / height - size[0] / size[1]) <= 2 / min(copy_size)  # the aspect, to a pixel's rounding
    assert min(copy_size) >= min(side, min(size))  # at least the side (or the whole image when smaller)
    assert factor == 1 or min(copy_size) < 2 * side
    # near-lossless: the copy is the box-reduced pixels, within JPEG q97's error
    reduced = np.asarray(image.reduce(factor) if factor > 1 else image, np.float32)
    assert np.abs(np.asarray(decoded, np.float32) - reduced).mean() < 2.0


@pytest.mark.parametrize("decode_side, side, fits", [(256, 256, True), (224, 320, True), (297, 256, False),
                                                     (None, 256, False), (0, 256, False), (32, 32, True)])
def test_a_model_fits_copies_whose_side_covers_its_preprocessing(decode_side, side, fits):
    assert kept.fits(decode_side, side) is fits


# -- the setting -----------------------------------------------------------------------------------------------------
def _store(tmp_path) -> Location:
    (tmp_path / "store").mkdir(exist_ok=True)
    return Location(str(tmp_path / "store"))


def test_the_side_kept_is_the_asked_one_else_the_recorded_else_the_sources(tmp_path):
    store = _store(tmp_path)
    assert pixels.keep_side(store, SLUG, None, None, "r1") == 0  # nothing asked, recorded or inherited
    assert not store.exists(pixels.setting_key(SLUG)), "nothing recorded for a model that keeps nothing"

    assert pixels.keep_side(store, SOURCE, 256, None, "r2") == 256  # asked: recorded
    assert store.read_json(pixels.setting_key(SOURCE))["side"] == 256
    assert pixels.keep_side(store, SOURCE, None, None, "r3") == 256  # a later run keeps the recorded side

    assert pixels.keep_side(store, SLUG, None, SOURCE, "r4") == 256  # a new model takes its source's setting
    record = store.read_json(pixels.setting_key(SLUG))
    assert (record["side"], record["run_id"], record["source"]) == (256, "r4", f"taken from model={SOURCE}")
    assert pixels.keep_side(store, SLUG, 320, SOURCE, "r5") == 320  # asked beats recorded and inherited
    assert pixels.read_setting(store, SLUG) == 320

    assert pixels.keep_side(store, SLUG, 0, SOURCE, "r6") == 0  # 0 turns it off, recorded as off ...
    assert pixels.read_setting(store, SLUG) == 0
    assert pixels.keep_side(store, SLUG, None, SOURCE, "r7") == 0  # ... and stays off, the source's not taken
    with pytest.raises(ValueError, match=r"keep_pixels: a side from 32 to 4096 pixels, or 0 \(off\); got 5"):
        pixels.keep_side(store, SLUG, 5, None, "r8")
    assert pixels.read_setting(store, SLUG) == 0, "a refused side records nothing"


@pytest.mark.parametrize("record", [
    b'{"side": "256"}', b'{"side": true}', b'{"side": 5}', b'{"side": 5000}', b'{"side": 256.0}',
    b'{"side": -256}', b'{"side": null}', b'{"width": 256}', b'[256]', b'"256"', b'256', b'{"side": 2',
    b'\xff\xfe not json', b'', b'[' * 10_000 + b']' * 10_000, b'{"side": 256, "pad": "' + b'x' * (17 << 20) + b'"}',
])
def test_a_hostile_setting_record_counts_as_none(tmp_path, record):
    store = _store(tmp_path)
    store.write_bytes(pixels.setting_key(SLUG), record)
    assert pixels.read_setting(store, SLUG) is None
    assert pixels.keep_side(store, SLUG, None, None, "r1") == 0  # and a run keeps nothing on its account


@pytest.mark.parametrize("side", [0, 32, 320, 4096])
def test_our_setting_records_read_back(tmp_path, side):
    store = _store(tmp_path)
    store.write_bytes(pixels.setting_key(SLUG), json.dumps({"side": side, "codec": "jpeg"}).encode())
    assert pixels.read_setting(store, SLUG) == side


# -- pixel files -----------------------------------------------------------------------------------------------------
def _copy(seed: int) -> tuple[bytes, int, int]:
    return kept.make_copy(gradient(seed, (96, 64)), 64)


def _publish(store: Location, shard: str, rows: list[tuple[str, str, bytes]], side: int = 64,
             slug: str = SOURCE) -> dict | None:
    writer = pixels.PixelShardWriter(side)
    for item_id, content_hash, data in rows:
        writer.add(item_id, content_hash, 96, 64, data)
    return writer.publish(store, slug, shard)


def test_a_pixel_file_round_trips_by_item_and_content_hash(tmp_path):
    store = _store(tmp_path)
    n = pixels.ROW_GROUP + 44  # two row groups
    copies = {f"p/{i:04d}.jpg": _copy(i)[0] for i in range(n)}
    published = _publish(store, "part-a", [(key, f"h{i}", data) for i, (key, data) in enumerate(copies.items())])
    key = pixels.pixels_key(SOURCE, 64, "part-a")
    assert key == f"pixels/model={SOURCE}/side=64/part-a.parquet"
    assert published == {"file": key, "side": 64, "codec": "jpeg", "quality": 97, "rows": n,
                         "bytes": (tmp_path / "store" / key).stat().st_size}
    meta = pq.ParquetFile(tmp_path / "store" / key).metadata
    assert meta.num_row_groups == 2 and meta.row_group(0).num_rows == pixels.ROW_GROUP
    assert pq.read_schema(tmp_path / "store" / key).remove_metadata().equals(pixels.SCHEMA)
    assert meta.metadata[b"imgest.side"] == b"64" and meta.metadata[b"imgest.codec"] == b"jpeg"

    # the copies asked for, with the hash the state says; another hash or an unknown item is passed over
    wanted = {"p/0003.jpg": "h3", "p/0290.jpg": "h290", "p/0007.jpg": "another hash", "p/9999.jpg": "h9999"}
    found = list(pixels.read_copies(store, SOURCE, 64, "part-a", wanted))
    assert [(c.item_id, c.content_hash) for c in found] == [("p/0003.jpg", "h3"), ("p/0290.jpg", "h290")]
    assert [c.data for c in found] == [copies["p/0003.jpg"], copies["p/0290.jpg"]]
    assert pixels.kept_shards(store, SOURCE).to_pylist() == [{"shard": "part-a", "side": 64}]
    assert pixels.models_keeping(store) == [SOURCE]


def test_a_shard_without_copies_publishes_no_pixel_file(tmp_path):
    store = _store(tmp_path)
    assert _publish(store, "part-empty", []) is None
    assert not store.exists(pixels.pixels_key(SOURCE, 64, "part-empty"))


def _write_file(path, table: pa.Table, **kw) -> None:
    """A Parquet file as imgest writes its pixel files (plain, uncompressed) unless `kw` says otherwise."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, **{"use_dictionary": False, "compression": "none", **kw})


def _rows(n: int, data: bytes = b"\xff\xd8 copy") -> pa.Table:
    return pa.table([[f"i{k}" for k in range(n)], [f"h{k}" for k in range(n)], pa.array([8] * n, pa.int32()),
                     pa.array([8] * n, pa.int32()), ["jpeg"] * n, [data] * n], schema=pixels.SCHEMA)


@pytest.fixture
def reads(monkeypatch) -> list:
    """Each row group read from a Parquet file (which, which columns): a refused file was never read."""
    seen, real = [], pq.ParquetFile.read_row_group

    def read_row_group(self, i, *args, **kwargs):
        seen.append((i, kwargs.get("columns")))
        return real(self, i, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", read_row_group)
    return seen


@pytest.mark.parametrize("damage, message", [
    ("missing", "missing"),
    ("truncated", "ArrowInvalid"),
    ("garbage", "ArrowInvalid"),
    ("wrong schema", "not a pixel file (schema ['item_id', 'content_hash', 'bytes'])"),
    ("widened column", "not a pixel file"),
    ("too many rows", "row group 0 of "),
    ("dictionary bomb", "row group 0 is compressed or dictionary- or delta-encoded; imgest writes pixel files plain"),
    ("delta bomb", "row group 0 is compressed or dictionary- or delta-encoded"),
    ("compressed", "row group 0 is compressed or dictionary- or delta-encoded"),
])
def test_a_pixel_file_that_is_not_ours_is_refused_before_a_copy_is_read(tmp_path, reads, damage, message):
    store = _store(tmp_path)
    path = tmp_path / "store" / pixels.pixels_key(SOURCE, 64, "part-x")
    if damage in ("truncated", "garbage"):
        _publish(store, "part-x", [("i0", "h0", _copy(0)[0])])
        whole = path.read_bytes()
        path.write_bytes(whole[:len(whole) // 2] if damage == "truncated" else b"PAR1" + b"\0" * 64 + whole[-8:])
    elif damage == "wrong schema":
        _write_file(path, pa.table({"item_id": ["i0"], "content_hash": ["h0"], "bytes": [b"x"]}))
    elif damage == "widened column":  # a width as int64: the right names, not our types
        _write_file(path, _rows(1).set_column(2, "width", pa.array([8], pa.int64())))
    elif damage == "too many rows":  # one row group of 4 x 256 + 1 rows: more than imgest writes in one
        _write_file(path, _rows(4 * pixels.ROW_GROUP + 1), row_group_size=10_000)
    elif damage == "dictionary bomb":  # 1,000 rows of one 1 MB value: a 60 kB file, 1 GB once read
        one = pa.DictionaryArray.from_arrays(pa.array(np.zeros(1000, np.int32)), pa.array([bytes(1 << 20)]))
        _write_file(path, _rows(1000).set_column(5, "bytes", one), use_dictionary=True, compression="zstd",
                    store_schema=False)  # written from a dictionary: 1 MB in memory here, not 1 GB
        assert path.stat().st_size < 100_000 and pq.ParquetFile(path).metadata.row_group(0).total_byte_size < \
            pixels.MAX_GROUP_BYTES, "the footer's sizes alone would let it through"
    elif damage == "delta bomb":  # the same through prefix compression
        _write_file(path, _rows(100, bytes(1 << 16)), column_encoding={"bytes": "DELTA_BYTE_ARRAY"})
    elif damage == "compressed":
        _write_file(path, _rows(3), compression="zstd")
    with pytest.raises(pixels.KeptPixelsError, match=r"^pixels/model=m-1111bbbb/side=64/part-x\.parquet: "):
        list(pixels.read_copies(store, SOURCE, 64, "part-x", {"i0": "h0"}))
    with pytest.raises(pixels.KeptPixelsError) as refused:
        list(pixels.read_copies(store, SOURCE, 64, "part-x", {"i0": "h0"}))
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert reads == [], "no row group was read"


def test_an_oversized_row_group_is_refused_from_its_footer_and_an_oversized_copy_passed_over(tmp_path, reads,
                                                                                           monkeypatch):
    """A row group's uncompressed size is checked from the footer against MAX_GROUP_BYTES (64 MB; lowered here
    to 1 MB so the test writes 1.5 MB, not 64), before any of it is read; a copy over MAX_COPY_BYTES (4 MB, the
    real limit) in a row group that passes is never handed on."""
    store = _store(tmp_path)
    path = tmp_path / "store" / pixels.pixels_key(SOURCE, 64, "part-x")
    _write_file(path, _rows(3, b"\xff\xd8" + bytes(500_000)))
    monkeypatch.setattr(pixels, "MAX_GROUP_BYTES", 1 << 20)
    with pytest.raises(pixels.KeptPixelsError, match=r"row group 0 of 1,50\d,\d{3} bytes, 3 rows: larger than "
                                                     r"imgest writes"):
        list(pixels.read_copies(store, SOURCE, 64, "part-x", {"i0": "h0"}))
    assert reads == []

    monkeypatch.undo()
    big = b"\xff\xd8" + bytes(kept.MAX_COPY_BYTES - 1)  # one byte over 4 MB
    _write_file(path, pa.concat_tables([_rows(1, big), _rows(2).slice(1)]))
    found = list(pixels.read_copies(store, SOURCE, 64, "part-x", {"i0": "h0", "i1": "h1"}))
    assert [c.item_id for c in found] == ["i1"]  # i0's copy is too large to be one of ours: its original is read


def _items(shard: str, *ids: str, side: int = 64) -> tuple[WorkItem, ...]:
    return tuple(WorkItem(item_id=i, uri=i, size=1, mtime=0.0, etag=None, prev_hash=None, kept_shard=shard,
                          kept_hash=f"h{i[1:]}", kept_side=side) for i in ids)


def test_a_planted_or_broken_pixel_file_sends_its_items_to_the_catalogue(tmp_path):
    """with_copies (the shard's reader): items whose copy is found come with it; an item with two rows in a planted
    file comes once; a row of other bytes, a missing row and a file that cannot be read send their items to the
    catalogue (None), the file's fault said once, naming it."""
    store = _store(tmp_path)
    _publish(store, "part-a", [("i0", "h0", b"copy-0"), ("i0", "h0", b"copy-0 again"), ("i1", "h1", b"copy-1"),
                               ("i2", "another hash", b"copy-2")])
    (tmp_path / "store" / pixels.pixels_key(SOURCE, 64, "part-b")).write_bytes(b"not parquet")
    items = (*_items("part-a", "i0", "i1", "i2", "i3"), *_items("part-b", "i4", "i5"),
             WorkItem("i6", "i6", 1, 0.0, None, None))  # no copy planned
    faults: list[str] = []
    got = [(item.item_id, data) for item, data in with_copies(items, store, SOURCE, faults)]
    assert sorted(got) == [("i0", b"copy-0"), ("i1", b"copy-1"), ("i2", None), ("i3", None), ("i4", None),
                           ("i5", None), ("i6", None)]
    assert len(got) == len(items), "every item once"
    assert len(faults) == 1 and faults[0].startswith(f"{pixels.pixels_key(SOURCE, 64, 'part-b')}: ")
    assert faults[0].endswith(": 2 item(s) read from the catalogue")


def test_an_image_whose_copy_cannot_be_made_is_encoded_without_one_and_the_run_says_why(tmp_path, monkeypatch):
    """The copy is storage only: an item whose copy fails (here the memory for it, injected) keeps its pixels, the
    model's own, and is encoded; its fault goes to the run's kept-pixels faults (a later model reads its original)."""
    from imgest.tasks.ingest import encode
    from tests.helpers import jpeg_bytes, write_files

    write_files(str(tmp_path / "cat"), {"p.jpg": jpeg_bytes(gradient(3, (640, 480)))})
    cat = Location(str(tmp_path / "cat"))
    item = WorkItem("p.jpg", cat.uri("p.jpg"), 1, None, None, None)
    plain = encode.prepare(cat, item, np.asarray, 10**8, 64, decoder="simplejpeg")
    kept_at_256 = encode.prepare(cat, item, np.asarray, 10**8, 64, decoder="simplejpeg", keep_side=256)
    assert kept_at_256.copy is not None and np.array_equal(kept_at_256.pixels, plain.pixels)

    def out_of_memory(image, side, quality=kept.QUALITY):
        raise MemoryError("no room for the copy")

    monkeypatch.setattr(kept, "make_copy", out_of_memory)
    done = encode.prepare(cat, item, np.asarray, 10**8, 64, decoder="simplejpeg", keep_side=256)
    assert done.reason is None and done.copy is None and np.array_equal(done.pixels, plain.pixels)
    assert done.copy_fault == "p.jpg: no kept copy (MemoryError: no room for the copy)"


def test_pixel_files_of_unreferenced_shards_and_killed_writes_are_removed(tmp_path):
    store = _store(tmp_path)
    for shard in ("part-a", "part-b"):
        _publish(store, shard, [("i0", "h0", b"copy")])
    _publish(store, "part-c", [("i0", "h0", b"copy")], side=128)
    root = tmp_path / "store" / pixels.pixels_prefix(SOURCE)
    (root / "side=64" / ".tmp-part-d.parquet").write_bytes(b"half a file")  # an upload killed before its rename
    (root / "notes").mkdir()
    (root / "notes" / "part-b.parquet").write_bytes(b"not in a side folder: not ours to delete")
    removed = pixels.remove_orphans(store, SOURCE, {"part-a"})
    assert sorted(removed) == ["side=128/part-c.parquet", "side=64/.tmp-part-d.parquet", "side=64/part-b.parquet"]
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*.parquet")) == \
        ["notes/part-b.parquet", "side=64/part-a.parquet"]
    assert pixels.remove_orphans(store, SOURCE, {"part-a"}) == []


# -- the command line ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [["ingest"], ["reencode", "--model", "raw-pixels"], ["nightly"],
                                     ["migrate", "start", "--to", "raw-pixels"]])
@pytest.mark.parametrize("side", ["5", "5000", "-1"])
def test_a_side_out_of_range_is_refused_in_one_line(tmp_path, command, side):
    (tmp_path / "catalogue").mkdir()
    store = tmp_path / "store"
    result = CliRunner().invoke(app, [*command, "--catalogue", str(tmp_path / "catalogue"), "--store", str(store),
                                      "--keep-pixels", side])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        f"imgest: error: keep_pixels: a shorter side from 32 to 4096 pixels, or 0 (off); got {side}"]
    assert not store.exists(), "refused before anything is written"


def test_the_side_is_an_option_of_every_command_that_encodes():
    for command in (["ingest"], ["reencode"], ["nightly"], ["migrate", "start"]):
        shown = CliRunner().invoke(app, [*command, "--help"], terminal_width=200).output
        assert "--keep-pixels" in shown, command


# -- through real ingests (slow: a Prefect server; a subprocess; real weights) ---------------------------------------
SIDE = 64  # raw-pixels' copies: the night and the kill are about copies following items, not about a model


def _ingest(catalogue, store, **kw) -> dict:
    kw.setdefault("batch_size", "4")
    kw.setdefault("shard_size", 5)
    kw.setdefault("decoder", "pillow")  # the JPEG decoder is not what is tested: none is timed
    return ingest_into(catalogue, store, **kw)


def _slug(model: str) -> str:
    from imgest import encoders

    return encoders.resolve(model).slug


def _live(store, slug: str) -> list:
    from imgest.state.committed import load_state

    state = load_state(Location(str(store)), slug)
    try:
        return state.live()
    finally:
        state.close()


def _copies(store, slug: str) -> dict[str, tuple[str, bytes]]:
    """item_id -> (content hash, copy) of every live item, reached through the state as a reader reaches it: its
    live row's shard's pixel file, the row of its content hash; each exactly once, no pixel file holding an item
    twice."""
    loc = Location(str(store))
    kept_shards = pixels.kept_shards(loc, slug).to_pydict()
    sides = dict(zip(kept_shards["shard"], kept_shards["side"]))
    by_shard: dict[str, list] = {}
    for item in _live(store, slug):
        by_shard.setdefault(item.shard, []).append(item)
    out = {}
    for shard, items in by_shard.items():
        assert shard in sides, f"live shard {shard} has no pixel file"
        table = loc.read_table(pixels.pixels_key(slug, sides[shard], shard))
        rows = list(zip(table["item_id"].to_pylist(), table["content_hash"].to_pylist(), table["bytes"].to_pylist()))
        assert len(rows) == len({item_id for item_id, _, _ in rows}), f"{shard}'s pixel file holds an item twice"
        for item in items:
            found = [(h, data) for item_id, h, data in rows if item_id == item.item_id and h == item.content_hash]
            assert len(found) == 1, (item.item_id, shard)
            out[item.item_id] = found[0]
    return out


def _referenced(store, slug: str) -> set[str]:
    """The shards the committed state refers to (live rows, and tombstones that can still be revived)."""
    from imgest.state.committed import load_state

    state = load_state(Location(str(store)), slug)
    try:
        return {item.shard for item in state.items.values() if item.shard}
    finally:
        state.close()


def _pixel_files(store, slug: str) -> dict[str, int]:
    """shard -> rows of each pixel file of `slug` (the files themselves, renamed into place)."""
    root = store / pixels.pixels_prefix(slug)
    return {p.stem: pq.ParquetFile(p).metadata.num_rows for p in root.glob("side=*/*.parquet")
            if not p.name.startswith(".")}


def _committed(store, slug: str) -> dict[str, dict]:
    """shard -> the `pixels` entry of its commit marker (markers of a run that did not finish: a finished run
    folds them into its snapshot)."""
    from tests.helpers import commit_markers

    return {p.stem: json.loads(p.read_text())["pixels"]
            for p in commit_markers(store / "state" / f"model={slug}", "commits/*.json")}


def _night_catalogue() -> dict[str, bytes]:
    from tests.helpers import jpeg_bytes, png_bytes

    files = {f"p/{i:02d}.jpg": jpeg_bytes(gradient(i, (320, 240))) for i in range(10)}
    files.update({f"p/{i:02d}.png": png_bytes(gradient(i, (240, 320))) for i in (10, 11)})
    return files


def _looks_like(copy: bytes, original: bytes) -> float:
    """Mean absolute difference (0-255) between a copy and an original, both at 32 x 24."""
    def small(data: bytes) -> np.ndarray:
        return np.asarray(Image.open(io.BytesIO(data)).convert("RGB").resize((32, 24), Image.Resampling.BOX),
                          np.float32)
    return float(np.abs(small(copy) - small(original)).mean())


@pytest.mark.usefixtures("prefect_harness")
def test_kept_copies_follow_the_catalogue_through_a_night_of_adds_changes_and_deletes(tmp_path):
    import os
    import time

    from tests.helpers import jpeg_bytes, write_files

    cat, store = tmp_path / "catalogue", tmp_path / "store"
    files = _night_catalogue()
    write_files(str(cat), files)
    slug = _slug("raw-pixels")

    first = _ingest(cat, store, model="raw-pixels", keep_pixels=SIDE)
    report = first["kept_pixels"]
    assert (report["side"], report["written"], report["reads"], report["source"]) == (SIDE, 12, "catalogue", None)
    assert report["why"] == "no other model in the store keeps pixels" and report["faults"] == []
    assert report["bytes"] == sum(p.stat().st_size for p in (store / "pixels").rglob("*.parquet"))
    assert json.loads((store / "runs" / f"{first['run_id']}.json").read_text())["kept_pixels"] == report
    assert pixels.read_setting(Location(str(store)), slug) == SIDE
    copies = _copies(store, slug)
    assert sorted(copies) == sorted(files)
    for key, (_, data) in copies.items():
        size = Image.open(io.BytesIO(data)).size
        # JPEGs: Pillow's 1/2 DCT decode (160 x 120) kept as it is; PNGs: 240 // 64 = 3, box-reduced to 80 x 107
        assert size == ((160, 120) if key.endswith(".jpg") else (80, 107)), (key, size)
        assert _looks_like(data, files[key]) < 3
    assert set(_pixel_files(store, slug)) == _referenced(store, slug) and sum(_pixel_files(store, slug).values()) == 12
    before = copies

    # The night: two added, one changed (other bytes), one touched (same bytes), one deleted.
    changed = jpeg_bytes(gradient(500, (320, 240)))
    write_files(str(cat), {"p/new-a.jpg": jpeg_bytes(gradient(900, (320, 240))),
                           "p/new-b.jpg": jpeg_bytes(gradient(901, (320, 240))), "p/01.jpg": changed})
    os.utime(cat / "p/02.jpg", (time.time() + 60, time.time() + 60))
    os.remove(cat / "p/03.jpg")
    second = _ingest(cat, store, model="raw-pixels")  # no --keep-pixels: the model's recorded setting holds
    assert (second["new"], second["changed"], second["deleted"], second["encoded"]) == (2, 1, 1, 3)
    assert (second["kept_pixels"]["side"], second["kept_pixels"]["written"]) == (SIDE, 3)

    after = _copies(store, slug)
    live = {item.item_id: item for item in _live(store, slug)}
    assert sorted(after) == sorted(live) == sorted({*files, "p/new-a.jpg", "p/new-b.jpg"} - {"p/03.jpg"})
    assert "p/03.jpg" not in after, "a deleted item's copy is not reachable"
    # the changed item's copy is its new bytes', in its new shard; the old one stays only where no live row points
    assert after["p/01.jpg"][0] == live["p/01.jpg"].content_hash != before["p/01.jpg"][0]
    assert _looks_like(after["p/01.jpg"][1], changed) < 3 < _looks_like(after["p/01.jpg"][1], files["p/01.jpg"])
    # the touched and the untouched keep the copy they had
    assert all(after[key] == before[key] for key in files if key not in ("p/01.jpg", "p/03.jpg"))
    assert set(_pixel_files(store, slug)) == _referenced(store, slug)

    # The deleted one comes back, same bytes: revived from its tombstone's shard, and so is its copy.
    write_files(str(cat), {"p/03.jpg": files["p/03.jpg"]})
    third = _ingest(cat, store, model="raw-pixels")
    assert third["new"] == 1 and third["encoded"] == 0 and third["kept_pixels"]["written"] == 0
    assert _copies(store, slug)["p/03.jpg"] == before["p/03.jpg"]


KILLED_BETWEEN_PIXELS_AND_MARKER = """
import sys, threading, time
import imgest.tasks.ingest.writer as writer

_publish, _lock, _calls = writer.ShardWriter._publish_pixels, threading.Lock(), []
def _publish_then_hang(self):
    published = _publish(self)
    with _lock:
        _calls.append(self.plan.name)
        later = len(_calls) > 1
    if later:  # the first shard commits; a later one stops with its pixel file uploaded and its marker not yet
        open(sys.argv[3], "w").close()
        time.sleep(3600)
    return published
writer.ShardWriter._publish_pixels = _publish_then_hang

from imgest.flows.ingest import ingest
ingest(config=dict(catalogue=sys.argv[1], store=sys.argv[2], model="raw-pixels", batch_size="2", shard_size=4,
                   keep_pixels=64, decoder="pillow"))
"""


@pytest.mark.slow("a subprocess killed")
@pytest.mark.usefixtures("prefect_harness")
def test_kill_9_between_a_pixel_file_and_its_marker_loses_nothing_and_duplicates_nothing(tmp_path):
    """The ingest is killed (SIGKILL, its whole process group) after its first shard committed, while a later
    shard has uploaded its pixel file but not written its commit marker: the resume commits every item once with
    one copy, and its orphan sweep removes the killed shard's unreferenced pixel file."""
    import os
    import pathlib
    import signal
    import subprocess
    import sys
    import time

    from prefect.settings import PREFECT_API_URL

    from tests.helpers import jpeg_bytes, write_files

    cat, store, hung = tmp_path / "catalogue", tmp_path / "store", tmp_path / "hung"
    files = {f"p/{i:02d}.jpg": jpeg_bytes(gradient(i, (320, 240))) for i in range(24)}
    write_files(str(cat), files)
    slug = _slug("raw-pixels")
    root = str(pathlib.Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": root}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_BETWEEN_PIXELS_AND_MARKER, str(cat), str(store), str(hung)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not hung.exists():
            assert proc.poll() is None, "the ingest ended before a later shard uploaded its pixel file"
            assert time.monotonic() < deadline, "no shard reached its pixel file in time"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    committed, kept_files = _committed(store, slug), _pixel_files(store, slug)
    orphans = set(kept_files) - set(committed)
    assert committed and orphans, (committed, kept_files)
    assert all(committed[shard]["rows"] == kept_files[shard] for shard in committed)
    assert not list(store.glob(f"state/model={slug}/snapshots/*.parquet")), "killed before its snapshot"
    done = sum(entry["rows"] for entry in committed.values())

    rerun = _ingest(cat, store, model="raw-pixels", batch_size="4", shard_size=10)
    assert rerun["resumed_shards"] == len(committed) and rerun["encoded"] == len(files) - done
    assert {f"side={SIDE}/{shard}.parquet" for shard in orphans} <= set(rerun["removed_orphans"])
    assert rerun["kept_pixels"]["side"] == SIDE and rerun["kept_pixels"]["written"] == len(files) - done
    copies = _copies(store, slug)
    assert sorted(copies) == sorted(files), "nothing lost"
    assert sum(_pixel_files(store, slug).values()) == len(files), "nothing kept twice, in any pixel file"
    assert set(_pixel_files(store, slug)) == _referenced(store, slug)
    assert all(_looks_like(data, files[key]) < 3 for key, (_, data) in copies.items())


# -- a model change reads the copies (real EfficientNet-Lite weights) -----------------------------------------------
REAL = {"runtime": "torch", "precision": "fp32", "batch_size": "8", "shard_size": 10}
PHOTOS = 40
GATE_PHOTOS = 32


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> tuple:
    """(catalogue folder, its files): 40 product photos (800-2000 px JPEGs, progressive, EXIF-rotated, PNG
    cut-outs)."""
    from imgest.images.demo import product_photos
    from tests.helpers import write_files

    files = product_photos(PHOTOS, seed=3)
    cat = tmp_path_factory.mktemp("photos") / "catalogue"
    write_files(str(cat), files)
    return cat, files


@pytest.fixture(scope="module")
def lite0_keeping(photos, tmp_path_factory, prefect_harness):
    """A store whose serving model, EfficientNet-Lite0, ingested the photos keeping copies at 256 (its decode
    side): 4 shards, 4 pixel files. Tests copy it."""
    store = tmp_path_factory.mktemp("lite0") / "store"
    run = _ingest(photos[0], store, model="efficientnet-lite0", keep_pixels=256, **REAL)
    assert run["encoded"] == PHOTOS and run["kept_pixels"]["written"] == PHOTOS
    return store


@pytest.fixture(scope="module")
def gem_from_originals(photos, tmp_path_factory, prefect_harness) -> dict[str, np.ndarray]:
    """EfficientNet-Lite0-GeM's vectors of the photos from the originals (a store where no model keeps pixels)."""
    store = tmp_path_factory.mktemp("gem") / "store"
    run = _ingest(photos[0], store, model="efficientnet-lite0-gem", **REAL)
    assert run["encoded"] == PHOTOS and run["kept_pixels"]["reads"] == "catalogue"
    assert run["kept_pixels"]["why"] == "no other model in the store keeps pixels"
    return _vectors(store, "efficientnet-lite0-gem")


@pytest.fixture
def small_gate_sample(monkeypatch):
    """The kept-pixels gate on the first 32 files of the parity sample (the same product photos, seed 0) instead of
    all 256: 6 s instead of 60 on two cores. Measured on both: EfficientNet-Lite0-GeM, copies at 256, mean cosine
    0.9986 / 0.9986, p1 0.9951 / 0.9937, overlap@10 0.975 / 0.988: it passes on either."""
    from imgest.encoders import parity

    files = parity._sample_files()[:GATE_PHOTOS]  # the run's sample, made once (product_photos is prefix-stable)
    monkeypatch.setattr(parity, "_files", lambda: files)


def _vectors(store, model: str) -> dict[str, np.ndarray]:
    from imgest.state.shards import embedding_matrix

    loc, slug, out = Location(str(store)), _slug(model), {}
    by_shard: dict[str, set] = {}
    for item in _live(store, slug):
        by_shard.setdefault(item.shard, set()).add(item.item_id)
    for shard, ids in by_shard.items():
        table = loc.read_table(f"embeddings/model={slug}/{shard}.parquet")
        matrix = embedding_matrix(table, table.schema.field("embedding").type.list_size)
        for item_id, vector in zip(table["item_id"].to_pylist(), matrix):
            if item_id in ids:
                assert item_id not in out, f"{item_id} twice"
                out[item_id] = vector
    return out


def _copy_store(source, tmp_path):
    import shutil

    shutil.copytree(source, tmp_path / "store")
    return tmp_path / "store"


@pytest.mark.slow("real weights")
def test_a_reencode_from_kept_pixels_equals_one_from_the_originals_within_the_gate(
        photos, lite0_keeping, gem_from_originals, small_gate_sample, tmp_path):
    store = _copy_store(lite0_keeping, tmp_path)
    run = _ingest(photos[0], store, model="efficientnet-lite0-gem", **REAL)
    report, lite0 = run["kept_pixels"], _slug("efficientnet-lite0")
    assert run["encoded"] == PHOTOS
    assert (report["reads"], report["source"], report["planned_from_kept"]) == ("kept pixels", lite0, PHOTOS)
    assert (report["from_kept"], report["from_catalogue"], report["faults"]) == (PHOTOS, 0, [])
    gate = report["gate"]
    assert gate["passed"] and gate["side"] == 256 and gate["images"] == GATE_PHOTOS
    assert gate["mean_cosine"] >= 0.998 and gate["p1_cosine"] >= 0.99 and gate["overlap"] >= 0.90
    assert report["why"].startswith(f"copies of model={lite0} at side >= 256 for 40 of 40 planned items (gate passed")
    recorded = Location(str(store)).read_json(f"state/model={_slug('efficientnet-lite0-gem')}/kept-gate.json")
    assert len(recorded) == 1 and recorded[0]["passed"] and recorded[0]["mean_cosine"] == gate["mean_cosine"]
    footers = [pq.read_schema(p).metadata for p in (store / "embeddings").glob("model=*/*.parquet")]
    assert sum(int(m.get(b"imgest.from_kept_pixels", 0)) for m in footers) == PHOTOS

    from_kept = _vectors(store, "efficientnet-lite0-gem")
    assert sorted(from_kept) == sorted(gem_from_originals) == sorted(photos[1])
    cosines = np.array([float(from_kept[key] @ gem_from_originals[key]) for key in photos[1]])
    assert cosines.mean() >= 0.998 and cosines.min() >= 0.98, np.sort(cosines)[:5]
    assert not np.allclose(cosines, 1.0, atol=1e-6), "the copies, not the originals, were decoded"

    # the new model took the source's setting: its own pixel files hold the copies it read, byte for byte
    assert report["side"] == 256 and report["written"] == PHOTOS
    assert _copies(store, _slug("efficientnet-lite0-gem")) == _copies(store, lite0)
    again = _ingest(photos[0], store, model="efficientnet-lite0-gem", **REAL)  # nothing new: the gate not measured
    assert again["encoded"] == 0 and again["kept_pixels"]["why"] == "nothing to decode"


@pytest.mark.slow("real weights")
@pytest.mark.usefixtures("prefect_harness")
def test_keeping_pixels_above_the_models_side_never_changes_its_vectors(photos, tmp_path):
    """Lite0 (decode side 256) ingested keeping copies at 448 and without: the same vectors, bit for bit (runtime,
    precision, batch and decoder fixed); the copies are decoded at 448, a second decode where the model's stops
    below it."""
    from tests.helpers import write_files

    files = dict(list(photos[1].items())[:12])
    cat = tmp_path / "catalogue"
    write_files(str(cat), files)
    options = {**REAL, "decoder": "simplejpeg"}
    keeping = _ingest(cat, tmp_path / "keeping", model="efficientnet-lite0", keep_pixels=448, **options)
    plain = _ingest(cat, tmp_path / "plain", model="efficientnet-lite0", **options)
    assert keeping["encoded"] == plain["encoded"] == len(files) and keeping["kept_pixels"]["written"] == len(files)
    assert keeping["encoding"]["decode_side"] == plain["encoding"]["decode_side"] == 256
    with_copies, without = _vectors(tmp_path / "keeping", "efficientnet-lite0"), _vectors(tmp_path / "plain",
                                                                                          "efficientnet-lite0")
    assert sorted(with_copies) == sorted(without) == sorted(files)
    assert all((with_copies[key] == without[key]).all() for key in files)
    for key, (_, copy) in _copies(tmp_path / "keeping", _slug("efficientnet-lite0")).items():
        with Image.open(io.BytesIO(copy)) as image:  # whole images under 448 are kept whole
            assert min(image.size) >= min(448, min(Image.open(io.BytesIO(files[key])).size)), key


@pytest.mark.slow("real weights")
def test_a_model_whose_side_exceeds_the_kept_side_reads_the_originals_and_says_why(photos, lite0_keeping, tmp_path):
    store = _copy_store(lite0_keeping, tmp_path)
    run = _ingest(photos[0], store, model="efficientnet-lite2", **REAL)
    report = run["kept_pixels"]
    assert run["encoded"] == PHOTOS
    assert (report["reads"], report["from_kept"], report["from_catalogue"], report["gate"]) == \
        ("catalogue", 0, PHOTOS, None)
    assert report["why"] == (f"efficientnet-lite2 decodes down to a shorter side of 297 and this run keeps 256; "
                             f"model={_slug('efficientnet-lite0')} keeps 256")
    assert not (store / "state" / f"model={_slug('efficientnet-lite2')}" / "kept-gate.json").exists()


@pytest.mark.slow("real weights")
def test_a_damaged_pixel_file_sends_its_items_to_the_catalogue_and_the_run_names_it(
        photos, lite0_keeping, gem_from_originals, small_gate_sample, tmp_path):
    """Four pixel files of ten copies: one truncated, one rewritten with another schema, one with a row of another
    content hash, a copy that is not a JPEG and a second row for an item, one intact. Every item is encoded; those
    whose copy could not be used from the catalogue, with the vector the originals give."""
    store = _copy_store(lite0_keeping, tmp_path)
    lite0 = _slug("efficientnet-lite0")
    files = sorted((store / pixels.pixels_prefix(lite0)).glob("side=256/*.parquet"))
    assert len(files) == 4
    ids = [pq.read_table(p, columns=["item_id"])["item_id"].to_pylist() for p in files]
    files[0].write_bytes(files[0].read_bytes()[:-5000])  # truncated: the footer is gone
    pq.write_table(pq.read_table(files[1]).drop_columns(["codec"]), files[1])  # not a pixel file
    planted = pq.read_table(files[2]).to_pylist()
    planted[0]["content_hash"] = "0" * 64  # a row of other bytes
    planted[1]["bytes"] = b"not a JPEG"  # a copy that does not decode
    planted.append({**planted[2], "bytes": b"a second row"})  # an item twice: the first row stands
    pq.write_table(pa.Table.from_pylist(planted, schema=pixels.SCHEMA), files[2], use_dictionary=False,
                   compression="none")

    run = _ingest(photos[0], store, model="efficientnet-lite0-gem", **REAL)
    report = run["kept_pixels"]
    assert run["encoded"] == PHOTOS and run["rejected"] == 0
    assert report["reads"] == "kept pixels" and report["planned_from_kept"] == PHOTOS  # planned from the state
    from_catalogue = {*ids[0], *ids[1], planted[0]["item_id"], planted[1]["item_id"]}
    assert (report["from_kept"], report["from_catalogue"]) == (PHOTOS - 22, 22)
    assert len(report["faults"]) == 2
    for path, fault in zip(files[:2], report["faults"]):
        key = path.relative_to(store).as_posix()
        assert fault.startswith(f"{key}: ") and fault.endswith(": 10 item(s) read from the catalogue"), fault

    vectors = _vectors(store, "efficientnet-lite0-gem")
    assert sorted(vectors) == sorted(photos[1])
    cosines = {key: float(vectors[key] @ gem_from_originals[key]) for key in vectors}
    assert all(cosines[key] >= 0.99999 for key in from_catalogue), "read from the originals, as without copies"
    assert np.mean([c for key, c in cosines.items() if key not in from_catalogue]) >= 0.998
    assert min(c for key, c in cosines.items() if key not in from_catalogue) < 0.99999, "those read the copies"


@pytest.mark.slow("real weights")
def test_a_migration_reads_the_serving_models_copies_and_keeps_none_when_told(
        photos, lite0_keeping, small_gate_sample, tmp_path):
    """The nightly of a model that keeps pixels keeps its setting and serves it; `migrate start --keep-pixels 0`
    re-encodes with the new model from the serving model's copies and keeps none of its own."""
    from imgest.config import MigrateConfig, NightlyConfig
    from imgest.flows.migrate import migrate
    from imgest.flows.nightly import nightly
    from imgest.state.aliases import read_alias

    store = _copy_store(lite0_keeping, tmp_path)
    lite0, gem = _slug("efficientnet-lite0"), _slug("efficientnet-lite0-gem")
    night = nightly(NightlyConfig(catalogue=str(photos[0]), store=str(store), model="efficientnet-lite0",
                                  kind="flat", decoder="pillow", **REAL))
    assert night["models"][0]["ingest"]["encoded"] == 0
    assert night["models"][0]["ingest"]["kept_pixels"] == {**night["models"][0]["ingest"]["kept_pixels"],
                                                           "side": 256, "why": "nothing to decode"}
    assert read_alias(Location(str(store)), "serving")["slug"] == lite0

    start = migrate(MigrateConfig(store=str(store), action="start", to="efficientnet-lite0-gem", kind="flat",
                                  keep_pixels=0, decoder="pillow", **REAL))
    assert start["window"]["to"]["slug"] == gem and start["coverage"]["share"] == 1.0
    runs = [json.loads(p.read_text()) for p in (store / "runs").glob("*.json")]
    report = next(r for r in runs if r["slug"] == gem)["kept_pixels"]
    assert (report["reads"], report["source"], report["from_kept"], report["side"], report["written"]) == \
        ("kept pixels", lite0, PHOTOS, 0, 0)
    assert pixels.read_setting(Location(str(store)), gem) == 0
    assert not (store / pixels.pixels_prefix(gem)).exists()


@pytest.mark.usefixtures("prefect_harness", "small_gate_sample")
def test_a_model_outside_the_gate_reads_the_originals_and_its_summary_has_the_figures(tmp_path):
    """raw-pixels models fit any kept side but their tiny squares move past the gate (measured 0.86-0.98 mean
    cosine): the new model reads the catalogue, the refusal and its figures are in the summary and recorded."""
    from imgest.config import ReencodeConfig
    from imgest.flows.reencode import reencode
    from tests.helpers import jpeg_bytes, write_files

    cat, store = tmp_path / "catalogue", tmp_path / "store"
    write_files(str(cat), {f"p/{i:02d}.jpg": jpeg_bytes(gradient(i, (640, 480))) for i in range(8)})
    _ingest(cat, store, model="raw-pixels", keep_pixels=SIDE)
    summary = reencode(ReencodeConfig(catalogue=str(cat), store=str(store), model="raw-pixels-16", batch_size="4",
                                      shard_size=5, decoder="pillow"))
    kept_report = summary["kept_pixels"]
    assert kept_report["reads"] == "catalogue" and kept_report["from_kept"] == 0
    assert kept_report["from_catalogue"] == summary["encoded"] == 8
    assert kept_report["gate"]["passed"] is False and "the gate refused copies of side 64" in kept_report["why"]
    assert "below the" in kept_report["why"]  # the shortfall, in figures
    gate = json.loads((store / "state" / f"model={_slug('raw-pixels-16')}" / "kept-gate.json").read_text())
    assert [entry["passed"] for entry in gate] == [False] and gate[0]["side"] == SIDE
