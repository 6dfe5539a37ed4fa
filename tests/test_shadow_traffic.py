"""Shadow traffic during a migration window: live queries served by `serving` are run again on the candidate off
the request path, recorded in the store, summarised by `migrate status` and required by `migrate promote
--min-shadow-agreement`; hostile shadow records are skipped."""

from __future__ import annotations

import base64
import json
import time

import httpx
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from imgest.cli import app
from imgest.config import MigrateConfig, NightlyConfig
from imgest.flows.migrate import migrate
from imgest.flows.nightly import nightly
from imgest.retrieval.following import Answer, FollowingSearcher
from imgest.retrieval.query import Query, Searcher
from imgest.state import shadow as records
from imgest.state.aliases import read_alias
from imgest.storage import Location, RecordError
from imgest.tasks.search.service import create_app
from imgest.tasks.search.shadow import ShadowTraffic
from tests.helpers import gradient, jpeg_bytes, served_app, write_files


def test_overlap_is_the_share_of_the_longer_list_both_hold():
    assert records.overlap(["a", "b", "c", "d"], ["d", "c", "b", "a"]) == 1.0  # order does not matter
    assert records.overlap(["a", "b", "c", "d"], ["a", "b", "x", "y"]) == 2 / 4
    assert records.overlap(["a", "b", "c", "d"], ["a"]) == 1 / 4  # a shorter answer is a disagreement
    assert records.overlap([], []) == 1.0 and records.overlap(["a"], []) == 0.0


def _row(overlap=0.5, served=2.0, shadow=3.0, error=None) -> dict:
    return {"at": "2026-12-02T00:00:00.000+00:00", "kind": "image", "k": 10, "overlap": overlap, "served_ms": served,
            "shadow_ms": shadow, "serving": "model=a v1", "shadow": "model=b v1", "error": error}


def test_summary_and_the_agreement_gate_read_only_valid_parts(tmp_path, caplog):
    store = Location(str(tmp_path))
    rows = [_row(overlap=n / 40, served=float(n), shadow=float(2 * n)) for n in range(1, 41)]
    records.write_part(store, "w-1", rows[:20], "test")
    records.write_part(store, "w-1", rows[20:] + [_row(overlap=None, shadow=None, error="boom")], "test")
    prefix = records.shadow_prefix("w-1")
    store.write_bytes(f"{prefix}/planted.parquet", b"not parquet")
    bad = pa.Table.from_pylist([_row(overlap=7.0)], schema=records.SCHEMA)
    store.write_table(f"{prefix}/out-of-range.parquet", bad)
    store.write_table(f"{prefix}/other-columns.parquet", pa.table({"overlap": [1.0]}))
    records.write_part(store, "w-2", [_row(overlap=0.0)], "another window")

    summary = records.summary(store, "w-1")
    # mean of n/40 for n = 1..40 = (41/2)/40; p50 of served 1..40 = 20.5; p99 = 39 + 0.61 = 39.61
    assert summary["queries"] == 40 and summary["errors"] == 1
    assert summary["mean_overlap"] == pytest.approx(41 / 80)
    assert summary["latency_ms"]["serving"] == {"p50": 20.5, "p99": 39.61}
    assert summary["latency_ms"]["shadow"] == {"p50": 41.0, "p99": 79.22}
    assert summary["compared"] == {"model=a v1 | model=b v1": 41}
    skipped = " ".join(r.getMessage() for r in caplog.records)
    assert "planted.parquet: skipped" in skipped and "out-of-range.parquet: skipped" in skipped
    assert "other-columns.parquet: skipped" in skipped

    assert records.check_agreement(summary, 0.5) is None
    assert "below the --min-shadow-agreement 0.6" in records.check_agreement(summary, 0.6)
    few = records.summary(store, "w-2")
    assert f"fewer than {records.MIN_QUERIES}" in records.check_agreement(few, 0.0)
    with pytest.raises(RecordError, match="not a window id"):
        records.shadow_prefix("../../etc")


def test_a_candidate_that_cannot_answer_is_recorded_as_an_error_not_raised(tmp_path):
    (tmp_path / "store").mkdir()
    traffic = ShadowTraffic(str(tmp_path / "store"), 1.0)
    from imgest.tasks.search.shadow import _Served

    row = traffic.run_one(_Served([Query("q", text="shoes")], 5, {}, ["a"], "model=a v1", 1.0, "now"))
    assert row["overlap"] is None and "not loaded yet" in row["error"] and traffic.failed == 1


@pytest.mark.slow("an HTTP server")
@pytest.mark.usefixtures("prefect_harness")
def test_shadow_traffic_is_recorded_shown_in_status_and_gates_promote(tmp_path, tiny_models):
    cat, store = tmp_path / "catalogue", tmp_path / "store"
    write_files(str(cat), {f"p/{i:03d}.jpg": jpeg_bytes(gradient(i, (96, 96))) for i in range(40)})
    old, new = "raw-pixels", f"hf:{tiny_models['dinov2']}"
    nightly(NightlyConfig(catalogue=str(cat), store=str(store), model=old, batch_size="8"))
    start = migrate(MigrateConfig(store=str(store), action="start", to=new, batch_size="8"))
    window = start["window"]

    follower = FollowingSearcher(str(store), ("serving",), device="cpu")
    follower.refresh()
    traffic = ShadowTraffic(str(store), 1.0, device="cpu", flush_rows=10, check_every_s=0.2)
    traffic.start()
    assert traffic.window is not None and traffic.window["id"] == window["id"]
    queries = [cat / "p" / f"{i:03d}.jpg" for i in range(0, 40)]
    try:
        with served_app(create_app(follower, shadow=traffic)) as url, httpx.Client(base_url=url, timeout=60) as http:
            for path in queries[:35]:
                body = {"image_b64": base64.b64encode(path.read_bytes()).decode(), "k": 5}
                assert http.post("/search", json=body).status_code == 200
            deadline = time.monotonic() + 120
            while traffic.recorded < 35 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert 'imgest_api_shadow_queries{outcome="recorded"} 35.0' in http.get("/metrics").text
    finally:
        traffic.close()
    assert traffic.recorded == 35 and traffic.failed == 0 and traffic.dropped == 0

    # the recorded overlap is what the two indexes answer for those queries, measured here independently
    serving, shadow = Searcher(str(store), "serving", device="cpu"), Searcher(str(store), "shadow", device="cpu")
    expected = []
    for path in queries[:35]:
        a = [h.item_id for h in serving.search([Query("q", image=str(path))], 5)[0]]
        b = [h.item_id for h in shadow.search([Query("q", image=str(path))], 5)[0]]
        expected.append(records.overlap(a, b))
    status = CliRunner().invoke(app, ["migrate", "status", "--store", str(store), "--json"])
    assert status.exit_code == 0, status.output
    summary = json.loads(status.stdout)["shadow"]
    assert summary["queries"] == 35 and summary["errors"] == 0 and summary["k"] == [5]
    assert summary["mean_overlap"] == pytest.approx(sum(expected) / len(expected), abs=1e-6)
    for side in ("serving", "shadow"):
        assert 0 < summary["latency_ms"][side]["p50"] <= summary["latency_ms"][side]["p99"]
    assert list(summary["compared"]) == [f"model={window['from']['slug']} v1 | model={window['to']['slug']} v1"]
    human = CliRunner().invoke(app, ["migrate", "status", "--store", str(store)])
    assert f"shadow traffic: mean overlap@k {summary['mean_overlap']:.4f} over 35 live queries" in human.stdout

    above = min(1.0, summary["mean_overlap"] + 0.05)
    refused = CliRunner().invoke(app, ["migrate", "promote", "--store", str(store), "--force", "canary",
                                       "--min-shadow-agreement", str(above)])
    assert refused.exit_code == 2 and "below the --min-shadow-agreement" in refused.output, refused.output
    assert read_alias(Location(str(store)), "serving")["slug"] == window["from"]["slug"]
    promoted = CliRunner().invoke(app, ["migrate", "promote", "--store", str(store), "--force", "canary",
                                        "--min-shadow-agreement", str(summary["mean_overlap"] - 0.01), "--json"])
    assert promoted.exit_code == 0, promoted.output
    event = [e for e in json.loads(promoted.stdout)["events"] if e["event"] == "promoted"][-1]
    assert event["shadow"]["queries"] == 35 and event["shadow"]["mean_overlap"] == summary["mean_overlap"]
    traffic.check()  # promoted: serving answers with the candidate itself, so nothing is compared
    now_serving = Answer([[]], {"serving": (window["to"]["slug"], 1)})
    assert traffic.window is not None and not traffic.offer([Query("q", text="x")], 5, {}, now_serving, 1.0)


def test_a_store_that_cannot_take_the_rows_loses_those_samples_not_the_service(tmp_path, caplog):
    """A flush that cannot write (here a file stands where the window's folder must go) drops its rows with a
    warning; the next rows are still measured and written once the store takes them."""
    store = tmp_path / "store"
    (store / "migration").mkdir(parents=True)
    (store / "migration" / "shadow").write_text("in the way")
    traffic = ShadowTraffic(str(store), 1.0)
    traffic.window = {"id": "w-1", "status": "open", "from": {"slug": "a"}, "to": {"slug": "b"}}
    traffic._rows = [_row()]
    traffic.flush()
    assert "shadow traffic: 1 rows not written" in caplog.text and traffic._rows == []
    (store / "migration" / "shadow").unlink()
    traffic._rows = [_row(), _row()]
    traffic.flush()
    assert records.summary(Location(str(store)), "w-1")["queries"] == 2
