"""imgest sync: Milvus Lite, Qdrant's local mode and LanceDB embedded, each kept in step with a store over three
nights of churn (top-10 equal to an exact numpy top-10 over the live vectors, ties tolerated; metadata carried);
another model's collection, a URL with credentials and a second sync at once refused in one line; kill -9
mid-sync, then a rerun converges with nothing missing, duplicated or left deleted. The nightly and the migration
window in the targets: tests/test_sync_window.py."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from imgest.cli import app
from imgest.config import SyncConfig
from imgest.state.live import load_live_vectors
from imgest.state.lock import StoreLock, StoreLockedError
from imgest.state.models import find_model
from imgest.storage import Location
from imgest.tasks.sync import watermark
from imgest.tasks.sync.run import sync
from imgest.tasks.sync.targets import Model, SyncError, credential, open_target, parse_target
from tests.helpers import gradient, ingest_into, png_bytes, write_files

MODEL = "raw-pixels"
ENGINES = ["milvus", "qdrant", "lancedb"]


def _url(engine: str, tmp_path, name: str = "products") -> str:
    return {"milvus": f"milvus://{tmp_path}/vectors.db/{name}", "qdrant": f"qdrant://{tmp_path}/qdrant/{name}",
            "lancedb": f"lancedb://{tmp_path}/lance/{name}"}[engine]


def _catalogue(cat, meta, images: dict[str, int], titles: dict[str, str]) -> None:
    for old in cat.glob("*.png") if cat.exists() else []:
        if old.name not in images:
            old.unlink()
    write_files(str(cat), {name: png_bytes(gradient(seed)) for name, seed in images.items()})
    meta.write_text("item_id,title,price\n" + "".join(f"{n},{titles[n]},{images[n]}.5\n" for n in sorted(images)))


def _ingest(tmp_path) -> None:
    ingest_into(tmp_path / "cat", tmp_path / "store", model=MODEL, batch_size="8", metadata=str(tmp_path / "meta.csv"),
                shard_size=8)


def _live(tmp_path, model: str = MODEL):
    store = Location(str(tmp_path / "store"))
    card = find_model(store, model)
    return load_live_vectors(store, card["slug"], int(card["dim"])), card


def _check_target(url: str, tmp_path, titles: dict[str, str], model: str = MODEL, named: bool = True) -> None:
    """The target's name (or with named=False the model's own collection) answers for `model`: it holds exactly
    its live items, their metadata, and answers like an exact search."""
    live, card = _live(tmp_path, model)
    target = open_target(parse_target(url))
    try:
        if named:
            assert target.open_named() == card["model_id"]
        else:
            target.open(Model(card["model_id"], card["slug"], int(card["dim"])), None)
        assert target.count() == len(live)
        rows = target.get(live.item_ids)
        assert sorted(rows) == sorted(live.item_ids)
        for item_id, row in rows.items():
            assert row["title"] == titles[item_id]
        rng = np.random.default_rng(0)
        queries = [live.vectors[i] for i in (0, len(live) // 2, len(live) - 1)]
        queries += [q / np.linalg.norm(q) for q in rng.normal(size=(2, live.vectors.shape[1])).astype(np.float32)]
        for query in queries:
            scores = live.vectors @ query
            order = np.argsort(-scores, kind="stable")[:10]
            hits = target.search(query, 10)
            assert len(hits) == 10
            got = np.array([s for _, s in hits])
            assert np.allclose(got, scores[order], atol=1e-3), (got, scores[order])
            tenth = scores[order[-1]]
            # ties tolerated: every item above the 10th score is in both, in any order among equals
            sure = {live.item_ids[i] for i in order if scores[i] > tenth + 1e-3}
            assert sure <= {item_id for item_id, _ in hits}
            assert {item_id for item_id, _ in hits} <= set(live.item_ids)
    finally:
        target.close()


def _sync(url: str, tmp_path, batch: int = 1000) -> dict:
    return sync(SyncConfig(store=str(tmp_path / "store"), to=url, model=MODEL, batch=batch))


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.parametrize("engine", ENGINES)
def test_sync_follows_three_nights_of_churn(engine, tmp_path):
    cat, meta, url = tmp_path / "cat", tmp_path / "meta.csv", _url(engine, tmp_path)
    images = {f"{i:03d}.png": i for i in range(24)}
    titles = {n: f"gradient {s}" for n, s in images.items()}
    _catalogue(cat, meta, images, titles)
    _ingest(tmp_path)
    first = _sync(url, tmp_path, batch=7)
    assert (first["upserted"], first["deleted"], first["live"]) == (24, 0, 24)
    assert first["watermark"]["key"].endswith("00000001.json")
    _check_target(url, tmp_path, titles)
    again = _sync(url, tmp_path)
    assert (again["upserted"], again["deleted"]) == (0, 0)

    # night 2: 3 new, 2 changed images, 2 deleted, 2 metadata rows changed
    for n in ("000.png", "001.png"):
        del images[n], titles[n]
    images.update({f"{i:03d}.png": i for i in range(24, 27)})
    images["005.png"], images["006.png"] = 105, 106
    titles.update({n: f"gradient {s}" for n, s in images.items()})
    titles["010.png"], titles["011.png"] = "renamed ten", "renamed eleven"
    _catalogue(cat, meta, images, titles)
    _ingest(tmp_path)
    second = _sync(url, tmp_path)
    assert (second["upserted"], second["deleted"], second["live"]) == (3 + 2 + 2, 2, 25)
    _check_target(url, tmp_path, titles)

    # night 3: one deleted item comes back with its old bytes (revived), two more go
    images["000.png"], titles["000.png"] = 0, "back again"
    for n in ("002.png", "003.png"):
        del images[n], titles[n]
    _catalogue(cat, meta, images, titles)
    _ingest(tmp_path)
    third = _sync(url, tmp_path)
    assert (third["upserted"], third["deleted"], third["live"]) == (1, 2, 24)
    _check_target(url, tmp_path, titles)

    # night 4: the feed gains a column: every row's metadata changed, so every item is sent again with it
    meta.write_text("item_id,title,price,colour\n" + "".join(f"{n},{titles[n]},{images[n]}.5,red\n"
                                                             for n in sorted(images)))
    _ingest(tmp_path)
    fourth = _sync(url, tmp_path)
    assert (fourth["upserted"], fourth["deleted"]) == (24, 0)
    target = open_target(parse_target(url))
    try:
        assert target.open_named() == first["model"]
        assert {row["colour"] for row in target.get(sorted(images)).values()} == {"red"}
    finally:
        target.close()
    store = Location(str(tmp_path / "store"))
    slug = watermark.model_dir(parse_target(url).slug, find_model(store, MODEL)["slug"])
    assert watermark.listing(store, slug) == {"json": [1, 2, 3, 4, 5], "intent": [], "manifest": [5]}
    assert watermark.last_watermark(store, slug)["live"] == 24


@pytest.fixture(scope="session")
def synced_original(tmp_path_factory, prefect_harness):
    """The catalogue, its text and the store every sync test starts from, ingested once per test process."""
    root = tmp_path_factory.mktemp("synced")
    images = {f"{i:03d}.png": i for i in range(30)}
    titles = {n: f"gradient {s}" for n, s in images.items()}
    _catalogue(root / "cat", root / "meta.csv", images, titles)
    _ingest(root)
    return root, images, titles


@pytest.fixture()
def synced_store(tmp_path, synced_original):
    """A copy of `synced_original` in this test's folder (its files' times kept, so the next night sees what
    changed, and the store's catalogue root pointed at the copy), which the test may change."""
    from imgest.state.catalogue_images import record_root

    root, images, titles = synced_original
    for name in ("cat", "store"):
        shutil.copytree(root / name, tmp_path / name)
    shutil.copy2(root / "meta.csv", tmp_path / "meta.csv")
    store = Location(str(tmp_path / "store"))
    record_root(store, find_model(store, MODEL)["slug"], Location(str(tmp_path / "cat")))
    return dict(images), dict(titles)


def _plant_another_model(url: str, slug: str) -> None:
    """The collection the model `slug` syncs into made by another model: <name>__<slug> (and, for LanceDB, TABLE
    held by a third model, so the model does not take TABLE itself)."""
    target = open_target(parse_target(url))
    try:
        target.open(Model("someone-else/other@1", "someone-else-other", 768), None, takes_name=True)
        target.point(Model("someone-else/other@1", "someone-else-other", 768))
        target.open(Model("someone-else/model@1234", slug, 768), None)
    finally:
        target.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_target_made_by_another_model_is_refused_in_one_line(engine, tmp_path, synced_store):
    """The collection a model syncs into holding another model's vectors: refused, never mixed."""
    url, slug = _url(engine, tmp_path), find_model(Location(str(tmp_path / "store")), MODEL)["slug"]
    _plant_another_model(url, slug)
    result = CliRunner().invoke(app, ["sync", "--store", str(tmp_path / "store"), "--to", url, "--model", MODEL])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "made by model someone-else/model@1234" in lines[0], result.output


@pytest.mark.parametrize("url, secret", [
    ("milvus://root:Milvus-s3cret@localhost:19530/products", "Milvus-s3cret"),
    ("qdrant://localhost:6333/products?api_key=qd-s3cret", "qd-s3cret"),
    ("lancedb://s3://AKIAEXAMPLE:aws-s3cret@bucket/lance/products", "aws-s3cret"),
    ("milvus://user:pw-s3cret@/tmp/x.db/products", "pw-s3cret"),
])
def test_a_target_url_with_credentials_is_refused_in_one_line(url, secret, tmp_path):
    (tmp_path / "store").mkdir()
    result = CliRunner().invoke(app, ["sync", "--store", str(tmp_path / "store"), "--to", url, "--model", MODEL])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1 and "refused" in result.output
    assert secret not in result.output


@pytest.mark.usefixtures("prefect_harness")
def test_a_targets_credential_from_a_prefect_secret_block(monkeypatch):
    """As for S3: only the block's name travels (an environment variable); the value is loaded where the target is
    opened and masked from then on; the variable itself, when set, wins."""
    from prefect.blocks.system import Secret

    from imgest.redact import redact

    value = "qdrant-api-key-" + os.urandom(8).hex()
    Secret(value=value).save("imgest-test-qdrant-key", overwrite=True)
    monkeypatch.delenv("QDRANT_API_KEY", raising=False)
    assert credential("QDRANT_API_KEY") is None
    monkeypatch.setenv("IMGEST_QDRANT_API_KEY_BLOCK", "imgest-test-qdrant-key")
    assert credential("QDRANT_API_KEY") == value
    assert value not in redact(f"connecting with {value}")
    monkeypatch.setenv("QDRANT_API_KEY", "from-the-environment")
    assert credential("QDRANT_API_KEY") == "from-the-environment"
    monkeypatch.delenv("QDRANT_API_KEY")
    for name, reason in (("imgest-no-such-block", "could not be loaded"), ("Not A Name!", "not a Prefect block name")):
        monkeypatch.setenv("IMGEST_QDRANT_API_KEY_BLOCK", name)
        with pytest.raises(SyncError, match=reason) as caught:
            credential("QDRANT_API_KEY")
        assert "\n" not in str(caught.value) and "Not A Name!" not in str(caught.value)


def test_target_url_forms():
    milvus = parse_target("milvus://milvus.internal:19530/products")
    assert (milvus.engine, milvus.where, milvus.name, milvus.local) == ("milvus", "milvus.internal:19530",
                                                                        "products", False)
    lite = parse_target("milvus:///data/vectors.db/products")
    assert (lite.where, lite.name, lite.local) == ("/data/vectors.db", "products", True)
    assert parse_target("qdrant:///data/qdrant/products").where == "/data/qdrant"
    assert parse_target("qdrant://localhost:6333/products").where == "localhost:6333"
    s3 = parse_target("lancedb://s3://bucket/lance/products")
    assert (s3.where, s3.name, s3.local) == ("s3://bucket/lance/products".rsplit("/", 1)[0], "products", False)
    assert parse_target("lancedb:///data/lance/products").where == "/data/lance"
    assert parse_target("milvus:///a/b.db/products").slug != parse_target("milvus:///a/c.db/products").slug
    for bad in ("weaviate://h:1/c", "milvus://localhost:19530", "milvus://localhost:19530/bad-name",
                "qdrant://localhost/c", "milvus://h:1/c?secure=1"):
        with pytest.raises(SyncError) as caught:
            parse_target(bad)
        assert "\n" not in str(caught.value)


def test_a_second_sync_of_one_target_is_refused(tmp_path, synced_store):
    url = _url("lancedb", tmp_path)
    folder = Location(str(tmp_path / "store" / "sync" / parse_target(url).slug))
    with StoreLock(folder, "another imgest sync"):
        with pytest.raises(StoreLockedError, match="another sync of it is running"):
            _sync(url, tmp_path)
    cli = ["sync", "--store", str(tmp_path / "store"), "--to", url]
    refused = CliRunner().invoke(app, cli)  # --alias serving by default: this store has no index yet
    assert refused.exit_code == 2 and "has no alias 'serving'" in refused.output
    result = CliRunner().invoke(app, [*cli, "--model", MODEL, "--batch", "8", "--json"])  # once the other is done
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # progress lines go to stderr
    assert report["target"] == url and report["model"].startswith("raw-pixels")
    assert (report["upserted"], report["deleted"], report["watermark"]["seq"]) == (30, 0, 1)
    again = CliRunner().invoke(app, [*cli, "--model", MODEL])
    assert again.exit_code == 0 and "0 item(s) upserted, 0 deleted" in again.output
    assert "30 live item(s)" in again.output and "00000002.json" in again.output


KILLED_SYNC = """
import sys
from imgest.config import SyncConfig
from imgest.tasks.sync import lance
from imgest.tasks.sync.run import sync
lance.MERGE_ROWS = 1  # LanceDB too commits each one-row batch: a kill lands between commits, not after the last
sync(SyncConfig(store=sys.argv[1], to=sys.argv[2], model="raw-pixels", batch=1))
"""


@pytest.mark.slow("a subprocess")
@pytest.mark.parametrize("engine", ENGINES)
def test_kill_9_mid_sync_then_a_rerun_converges(engine, tmp_path, synced_store):
    images, titles = synced_store
    url, store = _url(engine, tmp_path), Location(str(tmp_path / "store"))
    slug = watermark.model_dir(parse_target(url).slug, find_model(store, MODEL)["slug"])
    rng = random.Random(engine)
    _sync(url, tmp_path)
    kills = 0
    for night in range(2):
        for n in sorted(images)[:3]:  # deletes reach the target first, upserts after them
            del images[n], titles[n]
        images.update({f"n{night}-{i:03d}.png": 300 + 200 * night + i for i in range(150)})
        titles.update({n: f"gradient {s}" for n, s in images.items()})
        _catalogue(tmp_path / "cat", tmp_path / "meta.csv", images, titles)
        _ingest(tmp_path)
        before = len(watermark.listing(store, slug)["json"])
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        with open(tmp_path / "sync.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-c", KILLED_SYNC, str(tmp_path / "store"), url], env=env,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while not watermark.listing(store, slug)["intent"] and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.15))  # a random moment: deleting, upserting, or recording the watermark
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        listed = watermark.listing(store, slug)
        kills += bool(listed["intent"] and listed["intent"][-1] > listed["json"][-1])  # killed before its watermark
        rerun = _sync(url, tmp_path)
        assert len(watermark.listing(store, slug)["json"]) in (before + 1, before + 2)
        assert rerun["live"] == len(images)
        _check_target(url, tmp_path, titles)
    assert kills >= 1, "no kill landed before the watermark"


@pytest.fixture
def s3_for_lance(s3_each_endpoint):
    """An S3 API server on loopback, its endpoint and keys in the environment as users set them: each server, as
    LanceDB commits a table version by a conditional write, where S3 servers differ."""
    return s3_each_endpoint


@pytest.mark.slow("each S3 server")
def test_lancedb_on_an_object_store_with_credentials_from_the_environment(tmp_path, synced_store, s3_for_lance):
    import boto3

    boto3.client("s3", endpoint_url=s3_for_lance).create_bucket(Bucket="lance-target")
    images, titles = synced_store
    url = "lancedb://s3://lance-target/vectors/products"
    first = _sync(url, tmp_path)
    assert (first["upserted"], first["deleted"], first["live"]) == (30, 0, 30)
    _check_target(url, tmp_path, titles)
    assert _sync(url, tmp_path)["upserted"] == 0
