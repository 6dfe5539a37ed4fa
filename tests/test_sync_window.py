"""Sync targets in the pipeline's own steps: the nightly syncing each target after its builds (a bad target refused
before the night starts, a failing one recorded in one line with no watermark), and the migration window in the
target: a collection per model, the target's name moved by promote and rollback and seen there, the retired
model's collection dropped after finish; a collection or an earlier layout under the name refused."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from imgest.cli import app
from imgest.config import SyncConfig
from imgest.state.models import find_model
from imgest.storage import Location
from imgest.tasks.sync import watermark
from imgest.tasks.sync.targets import Model, open_target, parse_target
from tests import test_sync
from tests.test_sync import ENGINES, MODEL, _catalogue, _check_target, _plant_another_model, _url

synced_original, synced_store = test_sync.synced_original, test_sync.synced_store  # the fixtures, shared


@pytest.mark.usefixtures("prefect_harness")
def test_nightly_syncs_the_serving_model_to_each_target(tmp_path):
    from imgest.config import NightlyConfig
    from imgest.flows.nightly import nightly

    cat, meta = tmp_path / "cat", tmp_path / "meta.csv"
    images = {f"{i:03d}.png": i for i in range(20)}
    titles = {n: f"gradient {s}" for n, s in images.items()}
    urls = (_url("lancedb", tmp_path), _url("qdrant", tmp_path), _url("milvus", tmp_path))
    config = NightlyConfig(catalogue=str(cat), store=str(tmp_path / "store"), model=MODEL, batch_size="8",
                           metadata=str(meta), sync_to=urls)
    for night in range(2):
        if night:
            del images["000.png"], titles["000.png"]
            images["050.png"], titles["050.png"] = 50, "new tonight"
        _catalogue(cat, meta, images, titles)
        result = nightly(config)
        assert [s["target"] for s in result["synced"]] == list(urls)
        assert all(s["live"] == len(images) for s in result["synced"]), result["synced"]
        assert all((s["upserted"], s["deleted"]) == ((20, 0) if not night else (1, 1)) for s in result["synced"])
        for url in urls:
            _check_target(url, tmp_path, titles)


def test_nightly_refuses_a_bad_sync_target_before_it_starts(tmp_path):
    (tmp_path / "cat").mkdir()
    base = ["nightly", "--catalogue", str(tmp_path / "cat"), "--store", str(tmp_path / "store"), "--model", MODEL]
    for url, words in (("qdrant://localhost:6333/c?api_key=qd-s3cret", "refused"),
                       ("weaviate://localhost:8080/c", "unknown target")):
        result = CliRunner().invoke(app, [*base, "--sync-to", _url("lancedb", tmp_path), "--sync-to", url])
        assert result.exit_code == 2, result.output
        assert len(result.output.strip().splitlines()) == 1 and words in result.output
        assert "qd-s3cret" not in result.output
    assert not (tmp_path / "store").exists()  # nothing ran


def test_a_failing_target_is_recorded_in_one_line_and_nothing_is_watermarked(tmp_path, synced_store):
    from imgest.tasks.sync.run import sync_or_record

    url, store = _url("lancedb", tmp_path), Location(str(tmp_path / "store"))
    slug = find_model(store, MODEL)["slug"]
    _plant_another_model(url, slug)
    result = sync_or_record(SyncConfig(store=str(tmp_path / "store"), to=url, model=MODEL))
    assert set(result) == {"target", "error"} and "made by model someone-else" in result["error"]
    assert "\n" not in result["error"]
    assert watermark.listing(store, watermark.model_dir(parse_target(url).slug, slug))["json"] == []


@pytest.mark.parametrize("engine", ["milvus", "qdrant"])
def test_a_plain_collection_under_the_target_name_is_refused_in_one_line(engine, tmp_path, synced_store):
    """Milvus and Qdrant keep an alias under the target's name: a collection there (made outside imgest, or by
    a sync that wrote into the name itself) is refused before anything is created."""
    url = _url(engine, tmp_path)
    if engine == "milvus":
        from pymilvus import MilvusClient

        client = MilvusClient(uri=str(tmp_path / "vectors.db"))
        client.create_collection("products", dimension=8)
        client.close()
        from milvus_lite.server_manager import server_manager_instance

        server_manager_instance.release_server(str(tmp_path / "vectors.db"))
    else:
        from qdrant_client import QdrantClient, models

        client = QdrantClient(path=str(tmp_path / "qdrant"))
        client.create_collection("products", vectors_config=models.VectorParams(size=8, distance=models.Distance.DOT))
        client.close()
    result = CliRunner().invoke(app, ["sync", "--store", str(tmp_path / "store"), "--to", url, "--model", MODEL])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "products is a collection, not the alias imgest keeps there" in lines[0], lines


def test_a_target_synced_with_the_earlier_layout_is_refused_in_one_line(tmp_path, synced_store):
    """Watermarks written directly in the target's folder (before a collection per model): refused, naming
    what to drop."""
    url = _url("lancedb", tmp_path)
    store = Location(str(tmp_path / "store"))
    store.write_json(f"{watermark.target_dir(parse_target(url).slug)}/00000001.json", {"seq": 1})
    result = CliRunner().invoke(app, ["sync", "--store", str(tmp_path / "store"), "--to", url, "--model", MODEL])
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and "synced by an earlier imgest" in result.output


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.parametrize("engine", ENGINES)
def test_a_migration_window_in_the_target(engine, tmp_path, tiny_models):
    """The nightly syncs both models of an open window, each into its own collection; promote and rollback
    (with --sync-to) switch what the target's name answers for, its top-10 the exact top-10 of the model now
    serving; after finish the nightly syncs the one model left, and drops the retired one's collection once the
    store deleted its data."""
    from imgest.config import MigrateConfig, NightlyConfig
    from imgest.flows.migrate import migrate
    from imgest.flows.nightly import nightly

    cat, meta, url = tmp_path / "cat", tmp_path / "meta.csv", _url(engine, tmp_path)
    images = {f"{i:03d}.png": i for i in range(16)}
    titles = {n: f"gradient {s}" for n, s in images.items()}
    _catalogue(cat, meta, images, titles)
    config = NightlyConfig(catalogue=str(cat), store=str(tmp_path / "store"), model=MODEL, batch_size="8",
                           metadata=str(meta), sync_to=(url,))
    first = nightly(config)
    assert [(s["model"], s["answers"]) for s in first["synced"]] == [(first["ingest"]["model_id"], True)]
    _check_target(url, tmp_path, titles)
    old, new = first["ingest"]["model_id"], f"hf:{tiny_models['dinov2']}"
    start = migrate(MigrateConfig(store=str(tmp_path / "store"), action="start", to=new, batch_size="8"))
    new_id, new_slug = start["window"]["to"]["model_id"], start["window"]["to"]["slug"]

    # a night in the window, with changes: both models synced, the name still answers for the old one
    del images["000.png"], titles["000.png"]
    images["040.png"], titles["040.png"] = 40, "new in the window"
    _catalogue(cat, meta, images, titles)
    night = nightly(config)
    assert [(s["model"], s["answers"]) for s in night["synced"]] == [(old, True), (new_id, False)], night["synced"]
    assert night["synced"][1]["upserted"] == len(images)  # the candidate's first sync: every live item
    _check_target(url, tmp_path, titles, MODEL)
    _check_target(url, tmp_path, titles, new_slug, named=False)

    store = str(tmp_path / "store")
    promoted = migrate(MigrateConfig(store=store, action="promote", force="tested below", sync_to=(url,)))
    switch = promoted["targets"]["switched"]
    assert [(s["model"], s["answers"], s["upserted"], s["deleted"]) for s in switch] == [(new_id, True, 0, 0)]
    _check_target(url, tmp_path, titles, new_slug)  # the name answers with the new model's vectors, exact top-10
    # rollback from the command line, with a second target that cannot be opened (a file where LanceDB wants a
    # folder): the rollback and the first target's switch stand, the other is one line, the command exits 1
    broken = f"lancedb://{meta}/products"
    rolled = CliRunner().invoke(app, ["migrate", "rollback", "--store", store, "--sync-to", url, "--sync-to", broken])
    assert rolled.exit_code == 1, rolled.output
    assert f"Target `{url}`: answers for `{old}`" in rolled.output, rolled.output
    assert [line for line in rolled.output.splitlines() if line.startswith(f"Target `{broken}`: not switched")]
    _check_target(url, tmp_path, titles, MODEL)
    _check_target(url, tmp_path, titles, new_slug, named=False)  # kept beside, current for another promote
    migrate(MigrateConfig(store=store, action="promote", force="tested above", sync_to=(url,)))
    _check_target(url, tmp_path, titles, new_slug)
    finished = migrate(MigrateConfig(store=store, action="finish", retain_days=0))
    old_slug = first["ingest"]["slug"]
    assert finished["finished"]["deleted"] == [old_slug]  # the retention passed (0 days): the store deleted it

    # the next night syncs the one model left and drops the retired model's collection with its records
    images["041.png"], titles["041.png"] = 41, "after the window"
    _catalogue(cat, meta, images, titles)
    after = nightly(config)
    assert [(s["model"], s["answers"], s["upserted"], s["dropped"]) for s in after["synced"]] == \
        [(new_id, True, 1, [old_slug])]
    _check_target(url, tmp_path, titles, new_slug)
    assert watermark.synced_models(Location(store), parse_target(url).slug) == [new_slug]
    target = open_target(parse_target(url))
    try:
        assert not target.drop(Model(old, old_slug, 0)), "already dropped"
    finally:
        target.close()
