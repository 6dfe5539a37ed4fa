"""`imgest eval --candidates`: candidate models against the serving model on one sample, as one table; refusals."""

import json

import numpy as np
import pytest
from PIL import Image
from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from typer.testing import CliRunner

from imgest import encoders
from imgest.cli import app
from imgest.config import NightlyConfig
from imgest.flows.nightly import nightly
from imgest.images.demo import FASHION_CLASSES, photo, read_fashion_mnist
from imgest.reports.evaluation import candidates_table
from imgest.retrieval.querysets import build_class_queries
from imgest.timing import projected_hours

CANDIDATES = ("raw-pixels", "efficientnet-lite0-gem")
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "camera", "horse")
SAMPLE = 5  # live items drawn beside the 16 relevant ones: the sample is smaller than the catalogue's 26


@pytest.fixture(scope="module")
def compared(tmp_path_factory, prefect_harness):
    root = tmp_path_factory.mktemp("candidates")
    cat, store = root / "catalogue", root / "store"
    images, labels = read_fashion_mnist()
    for label in range(4):
        folder = cat / "fashion" / FASHION_CLASSES[label]
        folder.mkdir(parents=True)
        for index in np.flatnonzero(labels == label)[:5]:
            Image.fromarray(images[index]).save(folder / f"{index:05d}.png")
    (cat / "photos").mkdir()
    for name in PHOTOS:
        photo(name).convert("RGB").resize((96, 72)).save(cat / "photos" / f"{name}.jpg", quality=90)
    # serving: Lite0, in torch fp32 (the candidates run as serving's catalogue was encoded: which runtime that is,
    # and its conversions and parity checks, are tested elsewhere)
    nightly(NightlyConfig(catalogue=str(cat), store=str(store), batch_size="16", runtime="torch", precision="fp32"))
    queries = root / "class.jsonl"
    build_class_queries(str(cat), str(queries), per_class=1, seed=1, prefix="fashion/")  # 4 queries, 4 relevant each
    out = root / "out"
    result = CliRunner().invoke(app, ["eval", "--store", str(store), "--queries", str(queries), "--k", "1,5",
                                      "--candidates", ",".join(CANDIDATES), "--candidate-sample", str(SAMPLE),
                                      "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return {"report": json.loads(result.stdout), "markdown": (out / "eval.md").read_text()}


COLUMNS = ["model", "role", "model_id", "d", "recall@1", "recall@5", "recall@1 - serving (95% CI)",
           "recall@5 - serving (95% CI)", "runs on", "encode ms/image", "hours for 26"]


def test_the_comparison_table_has_one_row_per_model_and_its_columns(compared):
    result = compared["report"]["candidates"]
    table = candidates_table(result)
    assert [row["model"] for row in table] == ["efficientnet-lite0", *CANDIDATES]
    assert [row["role"] for row in table] == ["serving", "candidate", "candidate"]
    assert all(list(row) == COLUMNS for row in table)
    # the same columns in the markdown the command prints (and writes to eval.md)
    header = next(line for line in compared["markdown"].splitlines() if line.startswith("| model | role |"))
    assert [c.strip() for c in header.strip("|").split("|")] == COLUMNS
    assert "searched exactly over one sample of" in compared["markdown"]
    for row in table:
        assert row["model_id"] == encoders.resolve(row["model"]).model_id
        assert row["d"] == encoders.resolve(row["model"]).dim
    assert table[0]["recall@1 - serving (95% CI)"] == "-"  # the serving model is the reference, not compared
    with get_client(sync_client=True) as client:  # the flow's table artifact: the same rows
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["candidates"])))
    assert artifacts and [list(row) for row in json.loads(artifacts[-1].data)] == [COLUMNS] * 3


def test_the_figures_are_sane(compared):
    report = compared["report"]
    result = report["candidates"]
    assert result["catalogue_items"] == 26 and result["ks"] == [1, 5] and result["queries"] == 4
    sample = result["sample"]
    assert sample["relevant"] == 16 and 16 <= sample["items"] <= 16 + SAMPLE and sample["unreadable"] == 0
    serving, *candidates = result["models"]
    assert serving["vs_alias"] is None
    for row in result["models"]:
        recall = row["recall"]
        assert 0 <= recall["recall@1"] <= recall["recall@5"] <= 1
        assert row["images_timed"] == sample["items"] and row["encode_ms_per_image"] > 0
        # hours = N x per-image cost (to the 4 significant digits the projection keeps)
        assert row["projected_hours"] == pytest.approx(26 * row["encode_ms_per_image"] / 3.6e6, rel=2e-3)
    for row in candidates:
        for metric, boot in row["vs_alias"].items():
            assert boot["difference"] == pytest.approx(row["recall"][metric] - serving["recall"][metric])
            assert boot["low"] <= boot["difference"] <= boot["high"] and boot["resamples"] == 1000
    # fewer distractors can only raise a relevant item: recall on the sample is at least the catalogue's
    assert serving["recall"]["recall@5"] >= report["a"]["exact"]["recall@5"]
    # each model timed on the runtime that made the serving catalogue (raw pixels run as they are)
    assert serving["runtime"] == candidates[1]["runtime"] != "auto" and candidates[0]["runtime"].endswith("fp32")
    # raw pixels cost a fraction of a learned model per image
    assert candidates[0]["encode_ms_per_image"] < serving["encode_ms_per_image"]


@pytest.mark.parametrize("name,expected", [
    ("resnet9000", "candidates: unknown model 'resnet9000'; known: efficientnet-lite0, efficientnet-lite0-gem"),
    ("minilm-l6", "candidates: minilm-l6 is a text model over captions; candidates are image models"),
])
def test_a_candidate_that_is_no_image_model_is_refused_in_one_line(tmp_path, name, expected):
    result = CliRunner().invoke(app, ["eval", "--store", str(tmp_path), "--queries", str(tmp_path / "q.jsonl"),
                                      "--candidates", f"raw-pixels,{name}"])
    assert result.exit_code == 2 and expected in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


def test_projected_hours():
    # 3,600,000 images at 1,000 images/s: 3,600 s = 1 hour; 26 images at 40 ms each: 1.04 s = 0.000289 h (4 digits)
    assert projected_hours(3_600_000, 1000.0) == 1.0
    assert projected_hours(26, 1 / 0.040) == 0.0002889
