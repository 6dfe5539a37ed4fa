"""Model change end to end: re-encode killed and resumed, the dual-index window with catalogue changes,
promote/finish and promote/rollback, while a searcher runs throughout."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from typer.testing import CliRunner

from imgest.cli import app
from imgest.config import EvalConfig, MigrateConfig, NightlyConfig
from imgest.encoders import EncoderError
from imgest.flows.evaluate import evaluate
from imgest.flows.migrate import migrate
from imgest.flows.nightly import nightly
from imgest.retrieval.combined import fused_search
from imgest.retrieval.query import Query, Searcher
from imgest.state.aliases import read_alias
from imgest.state.window import read_window
from imgest.storage import Location
from imgest.tasks.migration.window import MigrationError, window_status
from tests.helpers import HANG_AFTER_FIRST_SHARD, commit_markers, events_seen, gradient, jpeg_bytes, write_files

pytestmark = pytest.mark.usefixtures("prefect_harness")


class SearchLoop:
    """Searches `serving` in a loop; records which model answered and any error."""

    def __init__(self, store, query):
        self.store, self.query = str(store), query
        self.models, self.errors, self.stop = [], [], threading.Event()
        self.answers, self.answered = [], threading.Condition()  # each search's model, None when it failed
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.is_set():
            model = None
            try:
                searcher = Searcher(self.store)
                hits = searcher.search([Query("q", image=self.query)], k=3)[0]
                assert len(hits) == 3
                model = searcher.card["model_id"]
                self.models.append(model)
            except Exception as exc:  # noqa: BLE001 - any error breaks the invariant
                self.errors.append(repr(exc))
            with self.answered:
                self.answers.append(model)
                self.answered.notify_all()
            self.stop.wait(0.05)

    def next_answer(self, timeout=120.0):
        """The model that answered the first search begun after this call (None: it failed, or none came)."""
        with self.answered:
            begun = len(self.answers) + 1  # the search under way now may have begun before the call
            self.answered.wait_for(lambda: len(self.answers) > begun, timeout)
            return self.answers[begun] if len(self.answers) > begun else None

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=60)


def catalogue(root, n, size=(96, 96)):
    write_files(str(root), {f"p/{i:03d}.jpg": jpeg_bytes(gradient(i, size)) for i in range(n)})


KILL_START = HANG_AFTER_FIRST_SHARD + """
import sys
from imgest.flows.migrate import migrate
migrate(config=dict(store=sys.argv[1], action="start", to=sys.argv[2], batch_size="1", shard_size=3))
"""


def test_promote_then_finish_with_kill_changes_and_searcher(tmp_path, tiny_models):
    from prefect.settings import PREFECT_API_URL

    cat, store = tmp_path / "catalogue", tmp_path / "store"
    catalogue(cat, 45, size=(320, 240))
    old = f"hf:{tiny_models['clip']}"
    base = nightly(NightlyConfig(catalogue=str(cat), store=str(store), model=old, batch_size="8"))
    old_id = base["ingest"]["model_id"]
    query = str(cat / "p" / "001.jpg")

    with pytest.raises(MigrationError, match="no migration window is open"):
        migrate(MigrateConfig(store=str(store), action="promote"))

    with SearchLoop(store, query) as loop:
        # Kill the start during its re-encode, then rerun the same command: it continues.
        env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": os.getcwd()}
        proc = subprocess.Popen([sys.executable, "-c", KILL_START, str(store), "efficientnet-lite0"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 180
        while time.time() < deadline and not commit_markers(store, "state/model=efficientnet*/commits/*.json"):
            assert proc.poll() is None, "migrate start ended before the re-encode committed a shard"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        committed = sum(json.loads(p.read_text())["rows"]
                        for p in commit_markers(store, "state/model=efficientnet*/commits/*.json"))
        assert 0 < committed < 45
        window = read_window(Location(str(store)))
        assert window["status"] == "open" and window["events"][-1]["event"] == "reencode-started"
        assert read_alias(Location(str(store)), "shadow") is None

        with pytest.raises(MigrationError, match="already open"):
            migrate(MigrateConfig(store=str(store), action="start", to=f"hf:{tiny_models['dinov2']}"))

        status = migrate(MigrateConfig(store=str(store), action="start", to="efficientnet-lite0", batch_size="4",
                                       shard_size=3))
        assert status["window"]["id"] == window["id"], "the same window resumed"
        assert status["coverage"]["share"] == 1.0 and status["index"]["to"]["current"]
        assert status["aliases"]["serving"]["slug"] == base["ingest"]["slug"]
        new_slug = status["window"]["to"]["slug"]
        assert status["aliases"]["shadow"]["slug"] == new_slug
        runs = [json.loads(p.read_text()) for p in (store / "runs").glob("*.json")]
        new_runs = [r for r in runs if r["slug"] == new_slug]
        assert [r["encoded"] for r in new_runs] == [45 - committed], "nothing committed before the kill is redone"
        assert new_runs[0]["resumed_shards"] >= 1

        # Catalogue changes during the window reach both models.
        write_files(str(cat), {"p/new.jpg": jpeg_bytes(gradient(999, (320, 240))),
                               "p/002.jpg": jpeg_bytes(gradient(555, (320, 240)))})
        os.remove(cat / "p" / "003.jpg")
        night = nightly(NightlyConfig(catalogue=str(cat), store=str(store), model=old, batch_size="4"))
        assert [r["ingest"]["slug"] for r in night["models"]] == [base["ingest"]["slug"], new_slug]
        for run in night["models"]:
            assert (run["ingest"]["new"], run["ingest"]["changed"], run["ingest"]["deleted"]) == (1, 1, 1)
            assert run["index"]["card"]["n"] == 45
        store_loc = Location(str(store))
        assert read_alias(store_loc, "serving")["version"] == 2 and read_alias(store_loc, "shadow")["version"] == 2

        fused_hits, encoded_by = fused_search(str(store), [Query("q", image=query)], k=5)
        fused = fused_hits[0]
        assert set(encoded_by) == {"serving", "shadow"} and all(encoded_by.values())  # each alias's query encoder
        assert len(fused) == 5 and "p/003.jpg" not in {h.item_id for h in fused}

        assert read_alias(store_loc, "serving")["slug"] == base["ingest"]["slug"], "the nightly never promotes"

        # Promote asks for proof: none recorded is refused; a real evaluation of shadow against serving on a
        # labelled query set is recorded in the window; a report showing shadow worse than the margin is refused.
        refused = CliRunner().invoke(app, ["migrate", "promote", "--store", str(store)])
        assert refused.exit_code == 2 and "no evaluation of shadow against serving" in refused.output
        queries = tmp_path / "queries.jsonl"
        queries.write_text("".join(json.dumps({"query_id": f"q{i}", "image": str(cat / "p" / f"{i:03d}.jpg"),
                                               "relevant": [f"p/{i:03d}.jpg"]}) + "\n" for i in range(4, 12)))
        report = evaluate(EvalConfig(store=str(store), queries=str(queries), alias="serving", compare="shadow",
                                     ks=(1, 5), resamples=200))
        recorded = read_window(store_loc)["evaluation"]
        assert recorded["query_file"] == str(queries) and recorded["queries"] == 8
        assert recorded["versions"]["shadow"] == {"slug": new_slug, "version": 2}
        worse = json.loads(json.dumps(report, default=str))
        worse["b"]["metrics"]["recall@5"] = worse["a"]["metrics"]["recall@5"] - 0.5
        gate = tmp_path / "eval.json"
        gate.write_text(json.dumps(worse))
        refused = CliRunner().invoke(app, ["migrate", "promote", "--store", str(store), "--gate", str(gate),
                                           "--margin", "0.05"])
        assert refused.exit_code == 2 and "worse than serving" in refused.output, refused.output
        assert read_window(store_loc)["evaluation"]["source"] == "imgest eval", "a refused gate is not recorded"

        promoted = migrate(MigrateConfig(store=str(store), action="promote", margin=0.2))
        assert promoted["aliases"]["serving"]["slug"] == new_slug
        assert promoted["aliases"]["previous"]["slug"] == base["ingest"]["slug"]
        event = [e for e in promoted["events"] if e["event"] == "promoted"][0]
        assert event["evaluation"]["metric"] == "recall@5" and event["margin"] == 0.2
        assert f"evaluated on {queries}" in read_alias(store_loc, "serving")["reason"]

        # Still in the window: the nightly keeps both current; serving follows the new model.
        nightly(NightlyConfig(catalogue=str(cat), store=str(store), model=old, batch_size="4"))
        assert read_alias(store_loc, "serving")["slug"] == new_slug
        finished = migrate(MigrateConfig(store=str(store), action="finish", retain_days=0))
        assert base["ingest"]["slug"] in finished["finished"]["deleted"]
    assert not loop.errors, loop.errors[:3]
    assert set(loop.models) == {old_id, status["window"]["to"]["model_id"]}, "both models served, never another"
    assert not (store / "embeddings" / f"model={base['ingest']['slug']}").exists()
    assert read_alias(store_loc, "previous") is None and read_window(store_loc) is None
    assert window_status(store_loc) == {"open": False}


def test_promote_then_rollback_and_refusals(tmp_path, tiny_models, monkeypatch):
    started = time.time()
    cat, store = tmp_path / "catalogue", tmp_path / "store"
    catalogue(cat, 12)
    old, new = f"hf:{tiny_models['clip']}", f"hf:{tiny_models['dinov2']}"
    with pytest.raises(MigrationError, match="nothing is serving yet"):
        (store / "x").mkdir(parents=True)
        migrate(MigrateConfig(store=str(store), action="start", to=new))
    base = nightly(NightlyConfig(catalogue=str(cat), store=str(store), model=old, batch_size="8"))
    unknown = CliRunner().invoke(app, ["migrate", "start", "--store", str(store), "--to", "resnet9000"])
    assert unknown.exit_code == 2 and "unknown model 'resnet9000'" in unknown.output

    # A model folder the operator has not listed: the nightly, build-index and search would refuse its name read
    # back from the store, so migrate start refuses it first, in one line naming the variable, with nothing
    # written: from the command (before Prefect starts) and from the flow (a deployment runs it directly).
    listed = os.environ["IMGEST_MODEL_DIRS"]
    monkeypatch.delenv("IMGEST_MODEL_DIRS")
    before = sorted(str(p) for p in store.rglob("*"))
    unlisted = CliRunner().invoke(app, ["migrate", "start", "--store", str(store), "--to", new])
    assert unlisted.exit_code == 2, unlisted.output
    assert "IMGEST_MODEL_DIRS" in unlisted.output and tiny_models["dinov2"] in unlisted.output, unlisted.output
    with pytest.raises(EncoderError, match="IMGEST_MODEL_DIRS"):
        migrate(MigrateConfig(store=str(store), action="start", to=new, batch_size="8"))
    assert sorted(str(p) for p in store.rglob("*")) == before, "nothing written: no window, no shard"
    monkeypatch.setenv("IMGEST_MODEL_DIRS", listed)

    start = migrate(MigrateConfig(store=str(store), action="start", to=new, batch_size="8"))
    new_slug = start["window"]["to"]["slug"]
    # listed when it was encoded, unlisted since: build-index names the reason, not "no model" behind a warning
    monkeypatch.delenv("IMGEST_MODEL_DIRS")
    gone = CliRunner().invoke(app, ["build-index", "--store", str(store), "--model", new_slug])
    assert gone.exit_code == 2 and "cannot be used" in gone.output and "IMGEST_MODEL_DIRS" in gone.output, \
        gone.output
    monkeypatch.setenv("IMGEST_MODEL_DIRS", listed)
    query = str(cat / "p" / "004.jpg")
    refused = CliRunner().invoke(app, ["migrate", "promote", "--store", str(store)])
    assert refused.exit_code == 2 and "no evaluation of shadow against serving" in refused.output
    assert read_alias(Location(str(store)), "serving")["slug"] == base["ingest"]["slug"]
    empty = CliRunner().invoke(app, ["migrate", "promote", "--store", str(store), "--force", " "])
    assert empty.exit_code == 2 and "force needs a reason" in empty.output
    with SearchLoop(store, query) as loop:
        forced = CliRunner().invoke(app, ["migrate", "promote", "--store", str(store), "--force",
                                          "canary traffic looked fine"])
        assert forced.exit_code == 0, forced.output
        assert loop.next_answer() == start["window"]["to"]["model_id"], "a search after the promote uses it"
        rolled = migrate(MigrateConfig(store=str(store), action="rollback"))
        assert loop.next_answer() == base["ingest"]["model_id"], "a search after the rollback is back on the old"
    assert rolled["aliases"]["serving"]["slug"] == base["ingest"]["slug"]
    assert not loop.errors, loop.errors[:3]
    promoted = [e for e in rolled["events"] if e["event"] == "promoted"]
    assert promoted[0]["forced"] == "canary traffic looked fine" and "no evaluation" in promoted[0]["unproven"]
    history = read_alias(Location(str(store)), "serving")["history"]
    assert "(forced: canary traffic looked fine)" in history[-1]["reason"], history[-1]
    finished = migrate(MigrateConfig(store=str(store), action="finish", retain_days=0))
    assert finished["finished"]["window"]["retired"]["slug"] == new_slug
    assert new_slug in finished["finished"]["deleted"]
    assert read_alias(Location(str(store)), "shadow") is None
    assert read_alias(Location(str(store)), "serving")["slug"] == base["ingest"]["slug"]
    # each step of the window was announced to Prefect, about the model it concerns
    steps = events_seen(["imgest.migration.opened", "imgest.migration.promoted", "imgest.migration.rolled-back",
                         "imgest.migration.finished"], lambda e: e.payload.get("window") == start["window"]["id"],
                        since=started)
    about = {e.event: e.resource.id for e in steps}
    assert about["imgest.migration.opened"] == about["imgest.migration.finished"] == f"imgest.model.{new_slug}"
    assert about["imgest.migration.rolled-back"] == f"imgest.model.{base['ingest']['slug']}"


def test_promote_rollback_finish_wait_for_the_writer_lock(tmp_path, tiny_models):
    """A nightly build holding the store (it moves aliases too) makes a promote fail with the holder named,
    changing nothing; once it is released the same command goes through."""
    from imgest.state.lock import StoreLock, StoreLockedError

    cat, store = tmp_path / "catalogue", tmp_path / "store"
    catalogue(cat, 6)
    base = nightly(NightlyConfig(catalogue=str(cat), store=str(store), model=f"hf:{tiny_models['clip']}",
                                 batch_size="8"))
    migrate(MigrateConfig(store=str(store), action="start", to=f"hf:{tiny_models['dinov2']}", batch_size="8"))
    loc = Location(str(store))
    with StoreLock(loc, owner="build-index@elsewhere:1"):
        for action in ("promote", "rollback", "finish"):
            with pytest.raises(StoreLockedError, match="locked by run build-index@elsewhere:1"):
                migrate(MigrateConfig(store=str(store), action=action, force="lock test"))
        assert read_alias(loc, "serving")["slug"] == base["ingest"]["slug"]
        assert read_window(loc)["status"] == "open"
    promoted = migrate(MigrateConfig(store=str(store), action="promote", force="lock test"))
    assert promoted["aliases"]["serving"]["slug"] == promoted["window"]["to"]["slug"]


def test_the_window_on_an_s3_store_with_a_searcher_following_serving(s3_endpoint, tmp_path, tiny_models):
    """The window on S3 (moto's server, then SeaweedFS): start, an evaluation, promote, rollback, promote,
    finish, with a long-lived searcher following `serving` through each move."""
    import s3fs

    from imgest.retrieval.following import FollowingSearcher

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})
    bucket = f"window-{os.urandom(3).hex()}"
    fs.mkdir(bucket)
    for i in range(12):
        fs.pipe(f"{bucket}/cat/p/{i:03d}.jpg", jpeg_bytes(gradient(i, (96, 96))))
    cat, store = f"s3://{bucket}/cat", f"s3://{bucket}/store"
    old, new = "raw-pixels", f"hf:{tiny_models['dinov2']}"
    base = nightly(NightlyConfig(catalogue=cat, store=store, model=old, batch_size="8"))
    follower = FollowingSearcher(store, ("serving",), device="cpu")
    assert follower.refresh() == ["serving"]
    query = Query("q", image_bytes=fs.cat(f"{bucket}/cat/p/004.jpg"))

    def served() -> str:
        answer = follower.search([query], k=3)
        assert answer.hits[0][0].item_id == "p/004.jpg"
        return answer.served["serving"][0]

    assert served() == base["ingest"]["slug"]
    start = migrate(MigrateConfig(store=store, action="start", to=new, batch_size="8"))
    new_slug = start["window"]["to"]["slug"]
    assert start["coverage"]["share"] == 1.0 and read_alias(Location(store), "shadow")["slug"] == new_slug
    queries = tmp_path / "queries.jsonl"
    queries.write_text("".join(json.dumps({"query_id": f"q{i}", "image": f"{cat}/p/{i:03d}.jpg",
                                           "relevant": [f"p/{i:03d}.jpg"]}) + "\n" for i in range(8)))
    evaluate(EvalConfig(store=store, queries=str(queries), alias="serving", compare="shadow", ks=(1, 5),
                        resamples=100))
    assert read_window(Location(store))["evaluation"]["queries"] == 8
    migrate(MigrateConfig(store=store, action="promote", margin=1.0))
    assert follower.refresh() == ["serving"] and served() == new_slug
    migrate(MigrateConfig(store=store, action="rollback"))
    assert follower.refresh() == ["serving"] and served() == base["ingest"]["slug"]
    migrate(MigrateConfig(store=store, action="promote", force="tested: the evaluation above"))
    finished = migrate(MigrateConfig(store=store, action="finish", retain_days=0))
    assert base["ingest"]["slug"] in finished["finished"]["deleted"]
    assert follower.refresh() == ["serving"] and served() == new_slug
    fs.invalidate_cache()
    assert not fs.glob(f"{bucket}/store/embeddings/model={base['ingest']['slug']}/*")
    assert follower.status()["serving"]["error"] is None
