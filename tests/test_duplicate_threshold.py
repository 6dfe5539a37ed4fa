"""The near-duplicate threshold calibrated per model and catalogue: copies made the ways catalogues copy images,
the same-picture check that keeps a catalogue's own copies out of the "different item" pairs, the stored record
(untrusted when read back), and planted catalogues of photos and of small art found at the defaults."""

from __future__ import annotations

import io
import json
import logging

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from imgest.cli import app
from imgest.images.decode import decode_image
from imgest.images.demo import photo, planted_duplicates
from imgest.storage import Location
from imgest.tasks.duplicates.calibrate import Calibration, latest_calibration, stale, write_calibration
from imgest.tasks.duplicates.hashes import hamming, perceptual_hash, picture
from imgest.tasks.duplicates.variants import KINDS, make_variant
from imgest.tasks.duplicates.verify import correlation, same_picture
from tests.helpers import write_files


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def _cutout() -> bytes:
    """A product (a cup of coffee) on a transparent background."""
    art = Image.new("RGBA", (160, 120), (0, 0, 0, 0))
    art.paste(photo("coffee").convert("RGBA").resize((100, 75)), (30, 20))
    return _png(art)


def test_each_kind_of_copy_decodes_to_the_picture_it_copies():
    rng = np.random.default_rng(0)
    original = decode_image(_cutout())  # transparency composited on white
    for kind in KINDS:
        copy = make_variant(_cutout(), kind, rng)
        decoded = decode_image(copy)
        opened = Image.open(io.BytesIO(copy))
        if kind in ("jpeg", "format", "exif-rotation"):  # same pixels, re-encoded: upright, alpha on white
            assert decoded.size == original.size, kind
            assert np.abs(np.asarray(decoded, float) - np.asarray(original, float)).mean() < 4, kind
            assert opened.format == "JPEG", kind
        if kind == "exif-rotation":  # stored turned, with the tag that turns it back
            assert opened.getexif().get(0x0112) in (3, 6, 8)
        if kind in ("resize", "crop", "pad"):
            assert opened.format == "PNG" and opened.mode == "RGBA", kind  # the cut-out stays a cut-out
        assert same_picture(picture(_cutout()), picture(copy)), kind
    with pytest.raises(ValueError, match="unknown variant kind 'blur'; kinds: jpeg"):
        make_variant(_cutout(), "blur", rng)


def test_same_picture_sees_through_crops_and_pads_but_not_between_photos():
    astronaut, coffee = photo("astronaut").convert("RGB"), photo("coffee").convert("RGB")
    w, h = astronaut.size
    cropped = astronaut.crop((w // 12, h // 14, w - w // 16, h - h // 10)).resize((300, 300))
    padded = Image.new("RGB", (w + 60, h + 40), "white")
    padded.paste(astronaut, (30, 20))
    assert correlation(astronaut, cropped) >= 0.95 and correlation(padded, astronaut) >= 0.95
    assert correlation(astronaut, coffee) < 0.9
    # the hash sees the pad (margins are trimmed) but not the crop
    assert hamming(perceptual_hash(astronaut), perceptual_hash(padded)) <= 4
    assert hamming(perceptual_hash(astronaut), perceptual_hash(cropped)) > 4


def _calibration(**changes) -> Calibration:
    values = dict(slug="m", model_id="model@1", created="2026-12-02T00:00:00+00:00", seed=0, items=100,
                  sample=["a", "b"], sample_hashes=["ha", "hb"], kinds=["jpeg"], target_recall=0.95,
                  min_precision=0.99, threshold=0.9, recall=1.0, precision=1.0, planted=[0.95, 0.97],
                  planted_hash=[0, 2], other=[0.5, 0.6], other_hash=[30, 28], recall_by_kind={"jpeg": 1.0})
    return Calibration(**{**values, **changes})


def test_a_calibration_is_reused_until_the_model_or_the_catalogue_changes_much():
    sample = {"a": "ha", "b": "hb"}  # the calibration's sampled items as the live set has them now
    assert stale(_calibration(items=102), "model@1", 102, sample) is None
    assert "model@2" in stale(_calibration(items=102), "model@2", 102, sample)
    assert "from 102 to 140 live items" in stale(_calibration(items=102), "model@1", 140, sample)
    assert "only 1 of its 2 sampled images" in stale(_calibration(items=102), "model@1", 102, sample | {"b": "changed"})
    assert "only 1 of its 2 sampled images" in stale(_calibration(items=102), "model@1", 102, {"a": "ha"})  # b gone


def test_a_planted_calibration_record_is_skipped_with_a_warning(tmp_path, caplog):
    store = Location(str(tmp_path / "store"))
    write_calibration(store, _calibration(), "20261201T000000000000")
    assert latest_calibration(store, "m").threshold == 0.9
    for planted in ({"threshold": 7}, {"threshold": 0}, {"slug": "other"}, {"planted": ["x"]},
                    {"hash_signal": {"floor": 0.5, "hash_distance": 64, "recall": 1, "precision": 1}},
                    {"recall_by_kind": {"blur": 1.0}}):
        record = {**json.loads(store.read_bytes("duplicates/calibration/model=m/20261201T000000000000.json")),
                  **planted}
        store.write_json("duplicates/calibration/model=m/20261202T000000000000.json", record)
        with caplog.at_level(logging.WARNING, logger="imgest"):
            assert latest_calibration(store, "m") is None, planted
        assert "is not a calibration imgest wrote" in caplog.text
    store.write_bytes("duplicates/calibration/model=m/20261202T000000000000.json", b'{"__class__": "os.system"}')
    assert latest_calibration(store, "m") is None


@pytest.mark.slow("real weights")
@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.parametrize("kind,originals,copies", [("photos", 24, 12), ("art", 30, 15)])
def test_planted_copies_are_found_at_the_defaults_and_no_group_joins_two_originals(tmp_path, kind, originals,
                                                                                    copies):
    """Copies at JPEG quality 60-70 (alpha composited), resizes and crops, with the real Lite0 weights."""
    files, planted = planted_duplicates(kind, originals, copies, seed=3)
    cat, store = tmp_path / "cat", tmp_path / "store"
    write_files(str(cat), files)
    runner = CliRunner()
    night = runner.invoke(app, ["nightly", "--catalogue", str(cat), "--store", str(store), "--batch-size", "8"])
    assert night.exit_code == 0, night.output

    out = runner.invoke(app, ["duplicates", "--store", str(store), "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    group_of = {item: n for n, group in enumerate(report["groups"]) for item in group["items"]}
    found = [copy for copy, original in planted.items() if copy in group_of and group_of.get(original) ==
             group_of[copy]]
    assert len(found) >= 0.9 * len(planted), (sorted(set(planted) - set(found)), report["threshold"])
    for group in report["groups"]:
        assert len({planted.get(item, item) for item in group["items"]}) == 1, group
    assert report["threshold_source"] == "calibration" and 0 < report["threshold"] < 0.97
    calibration = report["calibration"]
    assert calibration["sample"] == len(files) and calibration["planted_pairs"] == len(files) * len(KINDS)
    assert calibration["recall"] >= 0.5 and calibration["precision"] >= 0.99 and calibration["confirmed"] >= 0.9
    assert isinstance(report["refused_pairs"], int)  # every near pair was checked against its two pictures
    signals = {pair["signal"] for group in report["groups"] for pair in group["pairs"]}
    if calibration["hash_signal"]:
        assert calibration["hash_signal"]["recall"] > calibration["recall"]
    else:
        assert signals == {"embedding"}
    records = sorted((store / "duplicates" / "calibration").rglob("*.json"))
    assert len(records) == 1 and json.loads(records[0].read_text())["model_id"] == report["model_id"]

    again = json.loads(runner.invoke(app, ["duplicates", "--store", str(store), "--json"]).stdout)
    assert again["threshold"] == report["threshold"] and again["new_groups"] == 0
    assert len(list((store / "duplicates" / "calibration").rglob("*.json"))) == 1  # reused, not measured again
    fixed = json.loads(runner.invoke(app, ["duplicates", "--store", str(store), "--threshold", "0.99",
                                           "--json"]).stdout)
    assert fixed["threshold"] == 0.99 and fixed["threshold_source"] == "--threshold"
    assert fixed["calibration"]["recall"] <= calibration["recall"]  # the same measurement, at 0.99
    fresh = runner.invoke(app, ["duplicates", "--store", str(store), "--calibrate"])
    assert fresh.exit_code == 0 and "calibrated on this catalogue" in fresh.output, fresh.output
    assert len(list((store / "duplicates" / "calibration").rglob("*.json"))) == 2


def test_a_planted_hash_file_is_skipped_and_an_oversized_one_is_not_read(tmp_path, caplog):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from imgest.tasks.duplicates.hashes import HashCache

    store = Location(str(tmp_path / "store"))
    live = str(tmp_path / "live.parquet")  # the content hashes live now: what the cache keeps
    pq.write_table(pa.table({"content_hash": ["h1", "h2", "h3"]}), live)
    wanted = pa.array(["h1", "h2", "h3", "h9"])

    def found() -> dict:
        table = HashCache(store, max_rows=10).lookup(wanted)
        return dict(zip(table["content_hash"].to_pylist(), table["phash"].to_pylist()))

    def hashes(**new) -> pa.Table:
        return pa.table({"content_hash": list(new), "phash": pa.array(list(new.values()), pa.uint64())})

    HashCache(store, max_rows=10).write(hashes(h1=1, h2=2**64 - 1), live, "20261201T000000000000")
    assert found() == {"h1": 1, "h2": 2**64 - 1}
    pq.write_table(pa.table({"content_hash": ["h1", "h3"]}), live)  # h2's image is gone
    HashCache(store, max_rows=10).write(hashes(h3=3), live, "20261202T000000000000")  # the newest holds all
    assert [n for n in store.list_names("duplicates/hashes")] == ["20261202T000000000000.parquet"]
    assert found() == {"h1": 1, "h3": 3}
    store.write_table("duplicates/hashes/20261203T000000000000.parquet",
                      pa.table({"content_hash": ["h9"], "phash": ["not a number"]}))
    store.write_table("duplicates/hashes/20261204T000000000000.parquet",
                      pa.table({"content_hash": [f"x{n}" for n in range(50)],
                                "phash": pa.array(range(50), pa.uint64())}))
    store.write_bytes("duplicates/hashes/20261205T000000000000.parquet", b"PAR1 not parquet")
    with caplog.at_level(logging.WARNING, logger="imgest"):
        assert found() == {"h1": 1, "h3": 3}
    assert caplog.text.count("is not a hash file imgest wrote") == 3 and "50 rows, more than the 10" in caplog.text
