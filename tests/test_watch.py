"""Watching the nightly: a history row per model per night in the store, unusual nights marked against their
recent median, the events automations act on, the nightly-trend artifact and `imgest status --history`."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from imgest.cli import app
from imgest.storage import Location
from imgest.tasks.watch.history import read_history, reason_of, record_night
from imgest.tasks.watch.outliers import unusual
from tests.helpers import WebhookReceiver, events_seen, gradient, png_bytes, write_files


def _row(n: int, **figures) -> dict:
    return {"slug": "m-1a2b3c4d", "date": f"2031-01-{n:02d}", "finished": f"2031-01-{n:02d}T02:00:00+00:00",
            "run_id": f"r{n:08d}-x", "encoded": 200, "rejected_share": 0.0, "images_per_second": 40.0,
            "seconds": {"ingest": 100.0}, **figures}


def test_a_figure_is_marked_against_the_median_of_the_nights_before():
    earlier = [_row(1, rejected_share=0.0), _row(2, rejected_share=0.02)]
    # median 0.01; 0.6 is > 3 x 0.01 and 0.59 >= 0.2 from it: marked
    marks = unusual(_row(3, rejected_share=0.6), earlier)
    assert [(m["figure"], m["value"], m["median"], m["nights"]) for m in marks] == [("rejected_share", 0.6, 0.01, 2)]
    # 0.15 is > 3 x 0.01 but only 0.14 from it: a real change has to be at least the floor of 0.2
    assert unusual(_row(3, rejected_share=0.15), earlier) == []
    # one earlier night is not yet history
    assert unusual(_row(2, rejected_share=0.9), earlier[:1]) == []
    # throughput: 15 < 0.5 x median(40, 44) = 21 -> marked; 25 is not
    fast = [_row(1, images_per_second=40.0), _row(2, images_per_second=44.0)]
    assert [m["figure"] for m in unusual(_row(3, images_per_second=15.0), fast)] == ["images_per_second"]
    assert unusual(_row(3, images_per_second=25.0), fast) == []
    # ... but never judged on a night that encoded a handful of images
    assert unusual(_row(3, images_per_second=1.0, encoded=3), fast) == []


def test_history_rows_are_written_once_and_a_foreign_row_is_skipped(tmp_path, caplog):
    store = Location(str(tmp_path / "store"))
    first = record_night(store, _row(1))
    assert record_night(store, {**_row(1), "listed": 999}) == first  # a retried write changes nothing
    record_night(store, _row(2))
    store.write_bytes("history/nightly/model=m-1a2b3c4d/20310103T020000-zz.json", b'{"slug": "other"}')
    store.write_bytes("history/nightly/model=m-1a2b3c4d/20310104T020000-zz.json", b"not json")
    rows = read_history(store, "m-1a2b3c4d")
    assert [r["date"] for r in rows] == ["2031-01-01", "2031-01-02"] and "listed" not in rows[0]
    assert caplog.text.count("history: skipped") == 2
    assert [r["date"] for r in read_history(store, nights=1)] == ["2031-01-02"]


def test_rejections_are_counted_by_reason_not_by_their_details():
    assert reason_of("not an image: cannot identify image file 'a.jpg'") == "not an image"
    assert reason_of("too large (312 MB > 256 MB)") == "too large"
    assert reason_of("decode failed: broken data stream when reading image file") == "decode failed"


@pytest.mark.usefixtures("prefect_harness")
def test_three_nights_leave_a_trend_and_a_broken_third_night_is_marked_and_emits_its_event(tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from imgest.config import NightlyConfig
    from imgest.flows.nightly import nightly

    cat, store = tmp_path / "cat", tmp_path / "store"
    started = time.time()
    results = []
    for night in range(3):
        images = {f"p/n{night}-{i}.png": png_bytes(gradient(10 * night + i)) for i in range(8)}
        if night == 2:  # most of tonight's new images are broken
            images.update({f"p/n2-{i}.png": b"\x89PNG broken" for i in range(6)})
        write_files(str(cat), images)
        results.append(nightly(NightlyConfig(catalogue=str(cat), store=str(store), model="raw-pixels",
                                             batch_size="4")))
    slug = results[0]["ingest"]["slug"]
    rows = read_history(Location(str(store)), slug)
    assert [r["new"] for r in rows] == [8, 8, 8] and [r["rejected"] for r in rows] == [0, 0, 6]
    assert [r["listed"] for r in rows] == [8, 16, 24] and rows[0]["index"]["method"] == "build"
    assert rows[2]["rejected_by_reason"] and sum(rows[2]["rejected_by_reason"].values()) == 6
    assert [m["figure"] for m in rows[2]["marks"]] == ["rejected_share"] and rows[0]["marks"] == rows[1]["marks"] == []
    assert results[2]["night"]["events"] == ["imgest.rejected.high"]

    # the terminal shows the same nights, the marked figure with its `!`
    out = CliRunner().invoke(app, ["status", "--store", str(store), "--history", "--json"])
    assert out.exit_code == 0, out.output
    assert [r["run_id"] for r in json.loads(out.output)] == [r["run_id"] for r in rows]
    table = CliRunner().invoke(app, ["status", "--store", str(store), "--history"])
    assert table.exit_code == 0 and "!6 (75%)" in table.output and "rejected images far above" in table.output

    with get_client(sync_client=True) as client:
        trend = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["nightly-trend"])))
        mine = [a for a in trend if a.description and a.description.endswith(str(store))]
        assert len(mine) == 3, "one version of the key per night: the UI shows them as a timeline"
        markdown = max(mine, key=lambda a: a.created).data
        assert sum(line.startswith(f"| {rows[0]['date']}") for line in markdown.splitlines()) == 3
        assert "**6 (75%)**" in markdown and "data:image/png;base64," in markdown
    ours = lambda e: e.payload.get("store", "").endswith(str(store))  # noqa: E731
    found = events_seen(["imgest.rejected.high"], ours, since=started)
    payload = found[0].payload
    assert found[0].resource.id == f"imgest.model.{slug}"
    assert payload["figure"] == "rejected_share" and payload["value"] == 0.75 and payload["model"] == slug

    # a fourth night finds the catalogue gone: the mass delete is refused, the run fails, and watchers are told
    import shutil

    from imgest.tasks.ingest.plan import MassDeleteError

    shutil.rmtree(cat / "p")
    (cat / "p").mkdir()
    write_files(str(cat), {"p/last.png": png_bytes(gradient(99))})
    with pytest.raises(MassDeleteError):
        nightly(NightlyConfig(catalogue=str(cat), store=str(store), model="raw-pixels", batch_size="4"))
    refused = events_seen(["imgest.delete.refused"], ours, since=started)
    assert "tombstone" in refused[0].payload["message"] and refused[0].payload["max_delete_fraction"] == 0.2


@pytest.mark.usefixtures("prefect_harness")
def test_alerts_are_applied_once_and_a_failed_nightly_and_a_late_one_reach_the_webhook(tmp_path):
    from prefect.automations import Automation
    from prefect.client.orchestration import get_client

    from imgest.flows.nightly import nightly
    from imgest.tasks.watch.alerts import FAILED, LATE, REPORTED

    receiver = WebhookReceiver()
    try:
        for _ in range(2):  # twice: still one of each
            out = CliRunner().invoke(app, ["alerts", "apply", "--notify", receiver.url, "--json"])
            assert out.exit_code == 0, out.output
        assert [a["notifies"] for a in json.loads(out.output)] == [True, True, True]
        with get_client(sync_client=True) as client:
            assert [len(client.read_automations_by_name(n)) for n in (FAILED, LATE, REPORTED)] == [1, 1, 1]

        # a nightly whose catalogue cannot be listed fails; the webhook hears of it, with a link to the run
        state = nightly(config={"catalogue": str(tmp_path / "gone"), "store": str(tmp_path / "store")},
                        return_state=True)
        assert state.is_failed()
        run_id = str(state.state_details.flow_run_id)
        with get_client(sync_client=True) as client:
            run_name = client.read_flow_run(state.state_details.flow_run_id).name
        post = receiver.wait_for(run_name)
        assert "nightly" in post["subject"] and "Failed" in post["subject"], post
        assert run_id in post["body"] and str(tmp_path / "store") in post["body"], post

        # no nightly completes within a short window: the proactive alert fires
        out = CliRunner().invoke(app, ["alerts", "apply", "--notify", receiver.url, "--no-nightly-within", "0.004"])
        assert out.exit_code == 0, out.output
        post = receiver.wait_for("No nightly run completed", timeout=120)
        assert post["subject"] == "imgest: no nightly completed"
    finally:
        receiver.server.shutdown()
        for name in (FAILED, LATE, REPORTED):  # the session's other tests run without them
            try:
                Automation.read(name=name).delete()
            except ValueError:
                pass


def _embeddings(rng, n: int, centres: np.ndarray, spread: float = 0.35) -> np.ndarray:
    """Unit vectors around a few centres, as image embeddings of a catalogue's kinds of product are."""
    x = centres[rng.integers(0, len(centres), n)] + spread * rng.standard_normal((n, centres.shape[1]))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_drift_flags_a_planted_shift_and_not_a_random_resample():
    from imgest.state.drift import reference
    from imgest.tasks.watch.drift import measure

    rng = np.random.default_rng(7)
    centres = rng.standard_normal((12, 64))
    ref = reference(_embeddings(rng, 6000, centres), seed=1)
    # twenty random re-samples of the same catalogue, of night-sized batches: never an alert
    resampled = [measure(ref, _embeddings(rng, 60, centres)) for _ in range(20)]
    assert not any(r["high"] for r in resampled), [r["score"] for r in resampled]
    assert 0.0 <= np.mean([r["score"] for r in resampled]) <= 0.12  # about the 5% beyond a 95th percentile
    # new kinds of product the catalogue never had: an alert
    shifted = measure(ref, _embeddings(rng, 60, rng.standard_normal((3, 64))))
    assert shifted["high"] and shifted["score"] > 0.5 and shifted["p_value"] < 1e-6 and shifted["median_ratio"] > 1
    # half old, half new kinds: still a shift
    mixed = np.vstack([_embeddings(rng, 30, centres), _embeddings(rng, 30, rng.standard_normal((3, 64)))])
    assert measure(ref, mixed)["high"]
    assert measure(ref, _embeddings(rng, 3, centres)) is None  # too few new images to judge


@pytest.mark.usefixtures("prefect_harness")
def test_a_planted_shift_of_new_images_emits_drift_and_more_of_the_same_does_not(tmp_path, monkeypatch):
    from PIL import Image

    from imgest.config import NightlyConfig
    from imgest.flows.nightly import nightly

    cat, store = tmp_path / "cat", tmp_path / "store"
    rng = np.random.default_rng(3)

    def noise(n: int) -> bytes:  # a kind of image the catalogue never had
        return png_bytes(Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)))

    def run() -> dict:
        return nightly(NightlyConfig(catalogue=str(cat), store=str(store), model="raw-pixels", batch_size="16",
                                     kind="flat"))

    write_files(str(cat), {f"p/a{i:03d}.png": png_bytes(gradient(i)) for i in range(120)})
    first = run()["night"]
    assert first["drift"] is None  # nothing to judge against yet; the version trained tonight keeps a reference
    write_files(str(cat), {f"p/b{i:03d}.png": png_bytes(gradient(1000 + i)) for i in range(24)})
    same = run()["night"]
    assert same["drift"]["new"] == 24 and not same["drift"]["high"], same["drift"]
    assert "imgest.drift.high" not in same["events"]
    write_files(str(cat), {f"p/c{i:03d}.png": noise(i) for i in range(24)})
    shifted = run()["night"]
    assert shifted["drift"]["high"] and shifted["drift"]["score"] > 0.5, shifted["drift"]
    assert "imgest.drift.high" in shifted["events"]
    rows = read_history(Location(str(store)))
    assert [r["drift"] is not None and r["drift"]["high"] for r in rows] == [False, False, True]
    # a night larger than the sample (a model change's cold start) is measured on a seeded sample of it (against
    # the version serving now, which the third night built: what it measures is not the test here)
    from imgest.state.models import find_model
    from imgest.tasks.watch import drift

    slug, run_id = find_model(Location(str(store)), "raw-pixels")["slug"], rows[2]["run_id"]
    monkeypatch.setattr(drift, "SAMPLE", 12)
    sampled = drift.night_drift(Location(str(store)), slug, run_id)
    assert (sampled["new"], sampled["tonight"]) == (12, 24), sampled


def test_a_drift_reference_that_is_not_one_is_refused_and_the_night_goes_on(tmp_path, caplog):
    """A planted or damaged reference is never unpickled or trusted: read_reference refuses it by its members,
    sizes and shapes; the nightly's drift measurement then records none and says why."""
    import io
    import zipfile

    from imgest.state.drift import Reference, read_reference, reference_key, write_reference
    from imgest.storage.records import RecordError

    store = Location(str(tmp_path / "store"))
    rng = np.random.default_rng(0)
    write_reference(store, "m-1a2b3c4d", 1, Reference(rng.standard_normal((50, 8)).astype(np.float32),
                                                      rng.random(20).astype(np.float32)))
    assert read_reference(store, "m-1a2b3c4d", 1, 8).base.shape == (50, 8)
    with pytest.raises(RecordError, match="not a drift reference of d=16"):
        read_reference(store, "m-1a2b3c4d", 1, 16)  # another model's width
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as archive:  # inflates far past any reference
        archive.writestr("base.npy", b"\0" * (64 << 20))
        archive.writestr("distances.npy", b"\0")
    store.write_bytes(reference_key("m-1a2b3c4d", 2), bomb.getvalue())
    with pytest.raises(RecordError, match="not a drift reference"):
        read_reference(store, "m-1a2b3c4d", 2, 8)
    pickled = io.BytesIO()
    np.savez(pickled, base=np.array([{"x": 1}], dtype=object), distances=np.ones(3, np.float32))
    store.write_bytes(reference_key("m-1a2b3c4d", 3), pickled.getvalue())
    with pytest.raises(RecordError, match="not a drift reference"):
        read_reference(store, "m-1a2b3c4d", 3, 8)
    assert read_reference(store, "m-1a2b3c4d", 4, 8) is None  # a version built before references were kept


@pytest.mark.slow("a client's retry waits")
def test_alerts_apply_refuses_a_bad_target_or_window_and_an_unreachable_server_in_one_line():
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    bad = CliRunner().invoke(app, ["alerts", "apply", "--notify", "ftp://example.com/hook"])
    assert bad.exit_code == 2 and "--notify must be an http(s) webhook URL" in bad.output
    late = CliRunner().invoke(app, ["alerts", "apply", "--no-nightly-within", "0"])
    assert late.exit_code == 2 and "--no-nightly-within must be a number of hours > 0" in late.output
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api", PREFECT_CLIENT_MAX_RETRIES: 0}):
        down = CliRunner().invoke(app, ["alerts", "apply"])
    assert down.exit_code == 2 and "could not apply the alerts" in down.output
    assert len(down.output.strip().splitlines()) == 1, down.output
