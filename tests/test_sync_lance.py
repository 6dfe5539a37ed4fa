"""LanceDB as a target at scale, in small: a first sync is one append a reader meets whole or not at all (not one
merge a batch, each slower than the last: 1,077 rows/s at 10M); a night's changes are merged on an indexed
item_id in bounded commits; a shard the store cannot give back is the store's failure, not the target's."""

from __future__ import annotations

import lancedb
from typer.testing import CliRunner

from imgest.cli import app
from imgest.state.layout import embeddings_prefix
from imgest.state.models import find_model
from imgest.storage import Location
from imgest.tasks.sync import lance
from tests import test_sync
from tests.test_sync import MODEL, _catalogue, _check_target, _ingest, _url

synced_original, synced_store = test_sync.synced_original, test_sync.synced_store  # the fixtures, shared


def _sync(tmp_path, url: str, batch: int = 4):
    return CliRunner().invoke(app, ["sync", "--store", str(tmp_path / "store"), "--to", url, "--model", MODEL,
                                    "--batch", str(batch)])


def _table(tmp_path):
    return lancedb.connect(str(tmp_path / "lance")).open_table("products")


def test_a_first_sync_is_one_commit_a_reader_meets_whole_or_not_at_all(tmp_path, synced_store):
    images, titles = synced_store
    url = _url("lancedb", tmp_path)
    result = _sync(tmp_path, url)  # 30 items in batches of 4
    assert result.exit_code == 0, result.output
    _check_target(url, tmp_path, titles)
    table = _table(tmp_path)
    counts = set()
    for version in table.list_versions():
        table.checkout(version["version"])
        counts.add(table.count_rows())
    assert counts == {0, len(images)}  # never a table holding some of the batches
    table.checkout_latest()
    assert [list(index.columns) for index in table.list_indices()] == [["item_id"]]


def test_a_night_is_merged_in_commits_of_bounded_rows(tmp_path, synced_store, monkeypatch):
    images, titles = synced_store
    url = _url("lancedb", tmp_path)
    assert _sync(tmp_path, url).exit_code == 0
    monkeypatch.setattr(lance, "MERGE_ROWS", 3)  # batches of 4 cross it: a commit takes whole batches
    changed = {n: s + 100 for n, s in images.items() if s % 3 == 0}  # new bytes: new vectors
    retitled = {n: f"renamed {s}" for n, s in images.items() if s % 5 == 1}
    gone = {n for n, s in images.items() if s % 7 == 2}
    images = {n: changed.get(n, s) for n, s in images.items() if n not in gone} | {f"{i:03d}.png": i for i in
                                                                                   range(30, 41)}
    titles = {n: retitled.get(n, f"gradient {s}") for n, s in images.items()}
    _catalogue(tmp_path / "cat", tmp_path / "meta.csv", images, titles)
    _ingest(tmp_path)
    before = len(_table(tmp_path).list_versions())
    result = _sync(tmp_path, url)
    assert result.exit_code == 0, result.output
    _check_target(url, tmp_path, titles)  # every live item, its new vector and title; the deleted ones gone
    upserted = len(changed) - len(gone & set(changed)) + len(set(retitled) - set(changed) - gone) + 11
    assert len(_table(tmp_path).list_versions()) - before >= -(-upserted // 4)  # a commit per run, not one


def test_a_shard_the_store_cannot_give_back_is_the_stores_failure(tmp_path, synced_store):
    store = Location(str(tmp_path / "store"))
    slug = find_model(store, MODEL)["slug"]
    shard = sorted((tmp_path / "store" / embeddings_prefix(slug)).rglob("*.parquet"))[1]
    shard.write_bytes(b"not parquet")
    result = _sync(tmp_path, _url("lancedb", tmp_path))
    said = result.output.strip().splitlines()[-1]
    assert result.exit_code == 2, said  # the store's error, as any command reading a damaged store
    assert "batch" not in said and "lancedb" not in said, said  # not blamed on the target
    assert shard.name in said, said
