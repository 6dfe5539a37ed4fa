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
from imgest.demo import PHOTOS, photo
from imgest.tasks.duplicates.groups import find_duplicates

pytestmark = pytest.mark.usefixtures("prefect_harness")


def _jpeg(image: Image.Image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    image.convert("RGB").save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def test_groups_join_through_members_and_exact_needs_equal_bytes():
    ids = ["a", "b", "c", "d", "e"]
    hashes = ["h1", "h1", "h2", "h3", "h4"]
    neighbours = np.array([[1, 2], [0, -1], [3, 0], [2, -1], [0, 1]])
    scores = np.array([[1.0, 0.5], [1.0, 0.0], [0.98, 0.5], [0.98, 0.0], [0.9, 0.9]], np.float32)
    groups = find_duplicates(ids, hashes, scores, neighbours, 0.97)
    assert groups == [{"kind": "exact", "items": ["a", "b"], "min_score": 1.0},
                      {"kind": "near", "items": ["c", "d"], "min_score": 0.98}]


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
    report = json.loads(out.output)
    assert [(g["kind"], g["items"]) for g in report["groups"]] == [
        ("near", ["p/chelsea-q75.jpg", "p/chelsea-small.jpg", "p/chelsea.jpg"]),
        ("exact", ["p/astronaut.jpg", "p/copy-of-astronaut.jpg"])]
    assert report["groups"][0]["min_score"] >= 0.97 and report["new_groups"] == 2 and report["items"] == 13
    table = pq.read_table(store / report["key"])
    assert table.num_rows == 5 and table.schema.metadata[b"imgest.model_id"].decode() == report["model_id"]

    astronaut = photo("astronaut")
    (cat / "p/astronaut-crop.jpg").write_bytes(_jpeg(astronaut.crop((4, 4, astronaut.width - 4,
                                                                       astronaut.height - 4))))
    from imgest.flows.nightly import nightly

    again = nightly(NightlyConfig(catalogue=str(cat), store=str(store), batch_size="4", report_duplicates=True))
    assert again["duplicates"]["new_groups"] == 1  # the astronaut group grew: new; chelsea's is as before
    latest = json.loads(runner.invoke(app, ["duplicates", "--store", str(store), "--json"]).output)
    assert ["p/astronaut-crop.jpg", "p/astronaut.jpg", "p/copy-of-astronaut.jpg"] in \
        [g["items"] for g in latest["groups"]]
    assert latest["new_groups"] == 0
    strict = json.loads(runner.invoke(app, ["duplicates", "--store", str(store), "--threshold", "0.9999",
                                            "--json"]).output)
    assert [g["kind"] for g in strict["groups"]] == ["exact"]
