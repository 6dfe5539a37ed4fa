"""imgest duplicates: planted exact copies and re-encoded, resized copies found with the real Lite0 weights;
a Parquet report and an artifact; the nightly reports the groups that are new."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image
from typer.testing import CliRunner

from imgest.cli import app
from imgest.config import NightlyConfig
from imgest.images.demo import PHOTOS, photo
from imgest.tasks.duplicates.calibrate import choose_hash_signal, choose_threshold

pytestmark = pytest.mark.usefixtures("prefect_harness")


def _jpeg(image: Image.Image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    image.convert("RGB").save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def test_the_threshold_finds_the_target_share_of_each_kind_and_rises_over_different_items():
    # 10 originals, two kinds of copy each (rows: original; columns: kind), target 0.9 of each kind
    planted = np.array([[0.99, 0.90], [0.98, 0.91], [0.97, 0.92], [0.96, 0.93], [0.99, 0.94],
                        [0.98, 0.95], [0.97, 0.96], [0.99, 0.97], [0.98, 0.80], [0.97, 0.99]]).ravel()
    other = np.array([0.5, 0.6, 0.7, 0.7, 0.6, 0.5, 0.6, 0.7, 0.75, 0.8])
    # kind 2 sorted: 0.80 0.90 ...: one of ten below 0.90 is allowed -> 0.90; kind 1 allows 0.96: the lower wins
    assert choose_threshold(planted, other, 0.9, 0.99, kinds=2) == 0.90
    # a different item at 0.93: at 0.90, recall 19/20 = 0.95, false 1/10: precision 0.95 / 1.05 = 0.905 < 0.99,
    # so the threshold rises just above 0.93 (the 1e-4 grid): recall 15/20, no false pair
    other[-1] = 0.93
    assert choose_threshold(planted, other, 0.9, 0.99, kinds=2) == 0.9301
    # the hash signal takes pairs in [floor, threshold) whose hashes are within its distance
    planted_hash = np.array([0, 2, 1, 3, 0, 4, 2, 1, 0, 2, 1, 3, 0, 2, 1, 4, 9, 30, 2, 0])
    other_hash = np.array([30, 28, 31, 33, 29, 30, 27, 32, 26, 20])
    signal = choose_hash_signal(planted, planted_hash, other, other_hash, 0.9301, 0.99)
    # floor: the planted scores' 1% quantile, 0.80 + 0.19 x (0.90 - 0.80) = 0.819; the distance grows to its cap
    # (16 bits: the item at 20 never comes in); found: the 15 over the threshold, the four at 0.90-0.93 (2, 3, 4,
    # 1 bits), not the copy at 0.80 (30 bits): 19 of 20
    assert signal == {"floor": 0.819, "hash_distance": 16, "recall": 0.95, "precision": 1.0}


def test_planted_duplicates_are_found_and_new_ones_reported(tmp_path):
    cat, store = tmp_path / "cat", tmp_path / "store"
    (cat / "p").mkdir(parents=True)
    files = {f"p/{name}.jpg": _jpeg(photo(name)) for name in PHOTOS[:10]}
    files["p/copy-of-astronaut.jpg"] = files["p/astronaut.jpg"]  # the same bytes under another key
    chelsea = photo("chelsea")
    files["p/chelsea-q75.jpg"] = _jpeg(chelsea, 75)  # re-encoded
    files["p/chelsea-small.jpg"] = _jpeg(chelsea.resize((chelsea.width * 3 // 4, chelsea.height * 3 // 4)), 85)
    for key, data in files.items():
        (cat / key).write_bytes(data)
    runner = CliRunner()
    night = runner.invoke(app, ["nightly", "--catalogue", str(cat), "--store", str(store), "--batch-size", "4"])
    assert night.exit_code == 0, night.output

    out = runner.invoke(app, ["duplicates", "--store", str(store), "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    assert [(g["kind"], g["items"]) for g in report["groups"]] == [
        ("near", ["p/chelsea-q75.jpg", "p/chelsea-small.jpg", "p/chelsea.jpg"]),
        ("exact", ["p/astronaut.jpg", "p/copy-of-astronaut.jpg"])]
    assert report["groups"][0]["min_score"] >= 0.97 and report["new_groups"] == 2 and report["items"] == 13
    table = pq.read_table(store / report["key"])
    assert table.num_rows == 5 and table.schema.metadata[b"imgest.model_id"].decode() == report["model_id"]
    assert table.column_names == ["group", "kind", "found_by", "item_id", "uri", "min_score", "content_hash"]
    assert table["item_id"].to_pylist() == [i for g in report["groups"] for i in g["items"]]
    assert report["url"] == str(store / report["key"]) and report["groups_shown"] == 2
    assert (report["exact_groups"], report["near_groups"], report["exact_items"], report["near_items"]) == (1, 1, 2, 3)
    assert [g["size"] for g in report["groups"]] == [3, 2] and report["groups"][1]["found_by"] == "bytes"
    pairs = pq.read_table(store / report["pairs_key"]).to_pylist()  # the near pairs that joined chelsea's group
    assert {(p["a"], p["b"]) for p in pairs} == {(q["items"][0], q["items"][1]) for q in report["groups"][0]["pairs"]}
    assert len(pairs) == report["pairs"] >= 2 and {p["group"] for p in pairs} == {0}
    text = runner.invoke(app, ["duplicates", "--store", str(store)]).stdout
    assert "1 exact groups (2 items), 1 near groups (3 items)" in text and "p/copy-of-astronaut.jpg" in text

    astronaut = photo("astronaut")
    (cat / "p/astronaut-crop.jpg").write_bytes(_jpeg(astronaut.crop((4, 4, astronaut.width - 4,
                                                                       astronaut.height - 4))))
    from imgest.flows.nightly import nightly

    again = nightly(NightlyConfig(catalogue=str(cat), store=str(store), batch_size="4", report_duplicates=True))
    assert again["duplicates"]["new_groups"] == 1  # the astronaut group grew: new; chelsea's is as before
    latest = json.loads(runner.invoke(app, ["duplicates", "--store", str(store), "--json"]).stdout)
    assert ["p/astronaut-crop.jpg", "p/astronaut.jpg", "p/copy-of-astronaut.jpg"] in \
        [g["items"] for g in latest["groups"]]
    assert latest["new_groups"] == 0
    strict = json.loads(runner.invoke(app, ["duplicates", "--store", str(store), "--threshold", "0.9999",
                                            "--json"]).stdout)
    assert [g["kind"] for g in strict["groups"]] == ["exact"]

    # a copy is embedded as the catalogue's images were: by the JPEG decoder the model's runs recorded
    from imgest.images import decoders
    from imgest.images.decode import decode_image
    from imgest.storage import Location
    from imgest.tasks.duplicates.find import _searcher, embedder

    decoders.replace_record(Location(str(store)), report["slug"], decoders.Record("simplejpeg", decoders.EXPLICIT, "t"))
    searcher = _searcher(str(store), "serving", None)
    encoder, data = searcher.encoder(), files["p/chelsea-q75.jpg"]
    pixels = {name: encoder.preprocess(decode_image(data, min_side=encoder.decode_side, decoder=name))
              for name in ("simplejpeg", "pillow")}
    assert not np.array_equal(pixels["simplejpeg"], pixels["pillow"])  # 3/8 against Pillow's 1/2: they differ
    expected = encoder.encode_images(pixels["simplejpeg"][None])
    assert np.allclose(embedder(searcher)([data]), expected / np.linalg.norm(expected), atol=1e-6)
