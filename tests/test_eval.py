"""Evaluation end to end on real images: served vs exact, per class, A vs B, instance queries, gate."""

import json

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from imgest.cli import app
from imgest.config import EvalConfig, IndexConfig, NightlyConfig
from imgest.flows.build_index import build_index
from imgest.flows.evaluate import evaluate
from imgest.flows.nightly import nightly
from imgest.images.demo import FASHION_CLASSES, photo, read_fashion_mnist
from imgest.retrieval.querysets import build_class_queries, build_instance_queries, read_query_set
from imgest.tasks.migration.window import check_gate
from tests.helpers import ingest_into

pytestmark = pytest.mark.usefixtures("prefect_harness")
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "camera", "coins", "horse", "hubble_deep_field",
          "immunohistochemistry", "colorwheel")


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    cat, store = root / "catalogue", root / "store"
    images, labels = read_fashion_mnist()
    for label in range(6):
        folder = cat / "fashion" / FASHION_CLASSES[label]
        folder.mkdir(parents=True)
        for index in np.flatnonzero(labels == label)[:8]:
            Image.fromarray(images[index]).save(folder / f"{index:05d}.png")
    (cat / "photos").mkdir()
    for name in PHOTOS:
        photo(name).convert("RGB").save(cat / "photos" / f"{name}.jpg", quality=92)
    nightly(NightlyConfig(catalogue=str(cat), store=str(store), batch_size="4", kind="hnsw"))
    ingest_into(cat, store, model="raw-pixels", batch_size="16")
    build_index(IndexConfig(store=str(store), model="raw-pixels", alias="pixels"))
    class_file = root / "class.jsonl"
    meta = build_class_queries(str(cat), str(class_file), per_class=2, seed=1, prefix="fashion/")
    report = evaluate(EvalConfig(store=str(store), queries=str(class_file), alias="serving", compare="pixels",
                                 ks=(1, 5, 10), out=str(root / "out")))
    return {"root": root, "cat": cat, "store": store, "report": report, "meta": meta, "class_file": class_file}


def test_class_query_set_is_blind_and_seeded(evaluated):
    queries = read_query_set(str(evaluated["class_file"]))
    assert len(queries) == 12 and evaluated["meta"]["seed"] == 1
    for q in queries:
        item = q.exclude[0]
        assert item not in q.relevant and len(q.relevant) == 7 and item.split("/")[1] == q.cls
        assert item.startswith("fashion/")
    sidecar = json.loads((evaluated["root"] / "class.jsonl.meta.json").read_text())
    assert sidecar["kind"] == "class" and sidecar["self_match"] == "excluded"


def test_served_and_exact_per_class_and_comparison(evaluated):
    report = evaluated["report"]
    a = report["a"]
    assert a["factory"] == "HNSW32,Flat" and a["served"].startswith("efSearch=")
    for side in (a, report["b"]):
        m = side["metrics"]
        assert 0 <= m["recall@1"] <= m["recall@5"] <= m["recall@10"] <= 1
        assert 0 <= m["precision@10"] <= m["recall@10"] and 0 <= m["map"] <= 1
        assert set(side["exact"]) == set(m)
        ratio = side["served_over_exact"]["recall@10"]
        assert ratio is None or ratio == pytest.approx(m["recall@10"] / side["exact"]["recall@10"])
    assert a["relevant_indexed_share"] == 1.0
    # the learned model retrieves same-class items; measured on 12 queries over 6 classes of 8 images
    assert a["metrics"]["recall@10"] >= 0.5 and a["metrics"]["precision@10"] > 0
    assert set(a["per_class"]) == set(FASHION_CLASSES[:6])
    assert all(v["queries"] == 2 for v in a["per_class"].values())
    compare = report["compare"]
    for metric, cells in compare["win_loss"].items():
        assert sum(cells["counts"].values()) == report["queries"] == 12
        boot = compare["bootstrap"][metric]
        assert boot["resamples"] == 1000 and boot["low"] <= boot["difference"] <= boot["high"]
        assert boot["difference"] == pytest.approx(report["b"]["metrics"][metric] - a["metrics"][metric])
    assert set(compare["fusion"]) >= {"a", "b", "rrf", "max"}
    out = evaluated["root"] / "out"
    assert (out / "bootstrap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "recall-sweep-serving.png").exists()
    assert json.loads((out / "eval.json").read_text())["queries"] == 12


def test_instance_queries_find_their_original(evaluated):
    meta = build_instance_queries(str(evaluated["cat"]), str(evaluated["root"] / "instance"), prefix="photos/")
    assert meta["queries"] == 3 * len(PHOTOS)
    report = evaluate(EvalConfig(store=str(evaluated["store"]), queries=meta["file"], alias="serving",
                                 compare="pixels", ks=[1, 5]))
    lite0, pixels = report["a"]["metrics"], report["b"]["metrics"]
    assert set(report["a"]["per_class"]) == {"crop", "flip", "colour"}
    # The learned encoder finds the exact photo under crops, flips and colour shifts; it is measured, not assumed,
    # against the raw-pixel floor.
    assert lite0["recall@5"] >= 0.8
    assert lite0["mrr"] >= pixels["mrr"]


def test_gate_reads_an_eval_report():
    report = {"metric": "recall@10", "a": {"alias": "serving", "metrics": {"recall@10": 0.80}},
              "b": {"alias": "shadow", "metrics": {"recall@10": 0.76}}}
    assert check_gate(report, margin=0.05) is None
    assert "worse than serving" in check_gate(report, margin=0.01)


def test_cost_report_of_the_serving_model(tmp_path, tiny_models):
    from imgest.names import DEFAULT_SHARD_SIZE
    from imgest.reports.cost import cost_report, read_rehearsal
    from imgest.reports.index import render_cost
    from tests.helpers import gradient, png_bytes, write_files

    cat, store = tmp_path / "catalogue", tmp_path / "store"
    write_files(str(cat), {f"{i:02d}.png": png_bytes(gradient(i)) for i in range(8)})
    nightly(NightlyConfig(catalogue=str(cat), store=str(store), model=f"hf:{tiny_models['clip']}", batch_size="4"))
    n = 2_000_000
    rehearsal = tmp_path / "change-1m.log"  # the benchmark's log: its JSON is the last line
    rehearsal.write_text("[09:31:00] train-head: 18.0 s, peak 746 MB\n" + json.dumps(
        {"objects": 1_000_000, "date": "2026-12-04", "stages": {
            "train-head": {"seconds": 18.0, "peak_rss_mb": 746},
            "migrate start": {"seconds": 180.0, "peak_rss_mb": 971},
            "serve": {"seconds": 3.6, "peak_rss_mb": 421}}}) + "\n\n")
    report = cost_report(str(store), n, gpu_hour_price=2.5, node_memory="1G", min_seconds=0.05,
                         rehearsal=read_rehearsal(str(rehearsal)))
    best = report["encode_images_per_second"][str(report["best_batch"])]
    assert report["projected_encode_hours"] == pytest.approx(n / best / 3600, rel=1e-2)
    assert report["storage_bytes"]["fp32"] == 4 * 24 * n and report["storage_bytes"]["fp16"] == 2 * 24 * n
    assert report["query_encode_ms"]["text"] is not None and report["query_encode_ms"]["image"] > 0
    assert report["reencode_cost"]["price"] is None  # measured on a CPU: no GPU-hours to price
    # HNSW would fit 1G at 2M x 24, but past 100k items the rule keeps an index the nightly updates
    assert report["index"]["factory"] == "IVF11264,SQ8" and report["index"]["fits"]
    assert "GiB" in render_cost(report)
    change = report["model_change"]  # 2M from a rehearsal at 1M: twice each stage's time
    assert change["stages"]["migrate start"] == {"measured_seconds": 180.0, "projected_hours": 0.1,
                                                 "peak_rss_mb": 971}
    assert change["derived_model_hours"] == pytest.approx(0.11)  # the service answering is not the window's
    assert change["new_backbone_hours"] == pytest.approx(0.11 + report["projected_encode_hours"], rel=1e-3)
    assert "A model change at 2,000,000 items, from one rehearsed at 1,000,000" in render_cost(report)
    kept = report["kept_pixels"]  # the store keeps no copies: a copy's size is estimated on the parity photos
    assert sorted(kept["at"], key=int) == ["2000000", "4000000", "100000000"] and not kept["copies_measured"]
    at_4m = kept["at"]["4000000"]
    assert at_4m["objects_read"] == {"catalogue": 4_000_000, "kept pixels": 4_000_000 // DEFAULT_SHARD_SIZE}
    assert at_4m["bytes_read"]["kept pixels"] == at_4m["copies_storage_bytes"]
    assert at_4m["copies_storage_bytes"] == pytest.approx(4e6 * kept["copy_bytes_per_image"], rel=1e-3)
    assert at_4m["bytes_read"]["catalogue"] == pytest.approx(4e6 * kept["original_bytes_per_image"], rel=1e-3)
    assert "from the catalogue and from kept pixels" in render_cost(report)
    for bad in ('{"objects": 0, "stages": {"sync": {"seconds": 1}}}', '{"objects": 10, "stages": {}}', "[1, 2]",
                '{"objects": 10, "stages": {"sync": {"seconds": "soon"}}}', ""):
        rehearsal.write_text(bad)
        result = CliRunner().invoke(app, ["report", "cost", "--store", str(store), "--corpus-size", "10",
                                          "--rehearsal", str(rehearsal)])
        assert result.exit_code == 2 and "--rehearsal" in result.output, (bad, result.output)


def test_query_set_for_another_root_is_refused(evaluated, tmp_path):
    from imgest.retrieval.querysets import QuerySetError

    wrong = tmp_path / "wrong.jsonl"
    build_class_queries(str(evaluated["cat"] / "fashion"), str(wrong), per_class=1)  # ids relative to fashion/
    with pytest.raises(QuerySetError, match="none of the .* relevant item ids .* another catalogue root"):
        evaluate(EvalConfig(store=str(evaluated["store"]), queries=str(wrong)))


def test_serving_vs_shadow_evaluation_is_recorded_in_the_open_window(tmp_path):
    from imgest.state.window import read_window
    from imgest.storage import Location
    from imgest.tasks.migration.window import record_evaluation

    store = Location(str(tmp_path))
    store.write_json("migration/window.json", {"id": "w-1", "status": "open", "events": [],
                                               "from": {"name": "raw-pixels", "slug": "raw-pixels-1a2b3c4d"},
                                               "to": {"name": "efficientnet-lite0", "slug": "lite0-5e6f7a8b"}})
    report = {"metric": "recall@10", "queries": 40,
              "a": {"alias": "serving", "metrics": {"recall@10": 0.8}},
              "b": {"alias": "shadow", "metrics": {"recall@10": 0.85}},
              "compare": {"bootstrap": {"recall@10": {"low": 0.01, "high": 0.09}}}}
    record_evaluation(store, report)
    evaluation = read_window(store)["evaluation"]
    assert (evaluation["serving"], evaluation["shadow"], evaluation["queries"]) == (0.8, 0.85, 40)
    assert evaluation["interval"] == {"of": "shadow - serving", "low": 0.01, "high": 0.09}
    other = {**report, "b": {"alias": "pixels", "metrics": {"recall@10": 0.1}}}
    record_evaluation(store, other)  # not serving vs shadow: the window keeps the last relevant result
    assert read_window(store)["evaluation"]["shadow"] == 0.85


def test_exact_search_a_shard_at_a_time_equals_one_search_over_every_vector():
    """The evaluation's exact side reads the live vectors a shard at a time and keeps each query's best so far:
    the same lists as one exact search over all of them."""
    import faiss
    import pyarrow as pa

    from imgest.tasks.evaluate.retrievers import ExactScan

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((5000, 16)).astype(np.float32)
    names = np.array([f"item-{n:05d}" for n in range(len(vectors))], object)
    queries = rng.standard_normal((20, 16)).astype(np.float32)
    scan = ExactScan(queries, 30)
    for begin in range(0, len(vectors), 700):  # blocks of uneven size, the last short
        scan.add(vectors[begin:begin + 700], pa.array(names[begin:begin + 700]))
    scores, ids = faiss.knn(queries, vectors, 30, metric=faiss.METRIC_INNER_PRODUCT)
    np.testing.assert_allclose(scan.scores, scores, rtol=1e-6)
    assert (scan.names == names[ids]).all()


def test_a_class_query_set_holds_one_class_at_a_time_not_the_listing(tmp_path, monkeypatch):
    """The builder counts the classes and reads one class's keys at a time from the listing's files; the listing
    is never read whole. Labels are parent folders (a key at the top is `_root`), a class of one gives no query."""
    from imgest.images.listing import Listing
    from tests.helpers import write_files

    monkeypatch.setattr(Listing, "read", lambda self: pytest.fail("the whole listing was read"))
    keys = [f"shop/{c}/{i}.png" for c in ("boots", "cups") for i in range(4)] + ["shop/solo/1.png", "top.png",
                                                                                    "deep/a/boots/9.png"]
    write_files(str(tmp_path / "cat"), {key: b"\x89PNG" for key in keys})
    meta = build_class_queries(str(tmp_path / "cat"), str(tmp_path / "q.jsonl"), per_class=2, seed=3)
    assert meta["classes"] == ["_root", "boots", "cups", "solo"] and meta["queries"] == 4
    queries = read_query_set(str(tmp_path / "q.jsonl"))
    boots = [q for q in queries if q.cls == "boots"]
    assert len(boots) == 2 and all(len(q.relevant) == 4 and q.exclude[0] not in q.relevant for q in boots)
    every_boot = {key for key in keys if key.endswith(".png") and "/boots/" in key}  # its parent folder, anywhere
    assert all(set(q.relevant) | set(q.exclude) == every_boot for q in boots)
