"""A target that fails a sync, as the command line shows it: a batch the engine refuses is one line naming the
target, the batch and the engine's message, exit 1, no watermark; a Milvus Lite file another process holds is one
line saying what that means; an engine's error nothing foresaw is one line too (the last resort of every
command), its traceback only with --debug or IMGEST_DEBUG=1. Never a traceback otherwise, never a secret."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from imgest.cli import app
from imgest.config import SyncConfig
from imgest.state.models import find_model
from imgest.storage import Location
from imgest.tasks.sync import watermark
from imgest.tasks.sync.run import sync_or_record
from imgest.tasks.sync.targets import MODEL_KEY, SLUG_KEY, Model, parse_target, physical_name, target_failed
from tests import test_sync
from tests.test_sync import MODEL, _catalogue, _ingest, _url

synced_original, synced_store = test_sync.synced_original, test_sync.synced_store  # the fixtures, shared


def _sync_cli(tmp_path, url: str, *extra: str):
    return CliRunner().invoke(app, [*extra, "sync", "--store", str(tmp_path / "store"), "--to", url, "--model", MODEL])


def _sync_process(tmp_path, url: str, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`imgest sync` as a user runs it: everything the process writes comes back, what libraries log included."""
    command = [os.path.join(os.path.dirname(sys.executable), "imgest"), *extra, "sync", "--store",
               str(tmp_path / "store"), "--to", url, "--model", MODEL]
    return subprocess.run(command, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)


def _errors(output: str) -> list[str]:
    """What the command said about its failure: its lines starting `imgest:` (progress lines go to stderr too)."""
    return [line for line in output.splitlines() if line.startswith("imgest:")]


def _watermarks(tmp_path, url: str) -> list[int]:
    store = Location(str(tmp_path / "store"))
    folder = watermark.model_dir(parse_target(url).slug, find_model(store, MODEL)["slug"])
    return watermark.listing(store, folder)["json"]


def _plant_short_ids(tmp_path, url: str) -> None:
    """The model's collection as an earlier tool made it: the model's own (its id recorded), but item_id at most
    7 characters. Milvus refuses a longer id in the batch that carries it, on the server's side."""
    from milvus_lite.server_manager import server_manager_instance
    from pymilvus import DataType, MilvusClient

    card = find_model(Location(str(tmp_path / "store")), MODEL)
    spec, model = parse_target(url), Model(card["model_id"], card["slug"], int(card["dim"]))
    client = MilvusClient(uri=spec.where)
    schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=True)
    schema.add_field("item_id", DataType.VARCHAR, is_primary=True, max_length=7)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=model.dim)
    index = client.prepare_index_params()
    index.add_index("vector", index_type="FLAT", metric_type="IP")
    client.create_collection(physical_name(spec, model), schema=schema, index_params=index,
                             properties={MODEL_KEY: model.model_id, SLUG_KEY: model.slug})
    client.close()
    server_manager_instance.release_server(spec.where)


def test_a_batch_the_engine_refuses_is_one_line_exit_1_and_no_watermark(tmp_path, synced_store):
    images, titles = synced_store
    url = _url("milvus", tmp_path)
    _plant_short_ids(tmp_path, url)
    first = _sync_cli(tmp_path, url)  # 000.png ... 029.png: 7 characters, taken
    assert first.exit_code == 0, first.output
    assert _watermarks(tmp_path, url) == [1]

    del images["000.png"], titles["000.png"]
    images["a-longer-name.png"], titles["a-longer-name.png"] = 77, "too long for the collection"
    _catalogue(tmp_path / "cat", tmp_path / "meta.csv", images, titles)
    _ingest(tmp_path)
    failed = _sync_process(tmp_path, url)
    assert failed.returncode == 1, failed.stdout
    assert "Traceback" not in failed.stdout
    assert len(_errors(failed.stdout)) == 1, failed.stdout
    [line] = _errors(failed.stdout)
    # batch 1 deleted 000.png; batch 2 carried the long id
    assert line.startswith(f"imgest: sync to {url} failed: batch 2 of 2 (upserting items 1-1 of 1): "), line
    assert "MilvusException" in line and "exceeds max_length=7" in line, line
    assert _watermarks(tmp_path, url) == [1]  # nothing recorded: the next sync sends it all again
    # a nightly's sync records the same reason, once prefixed by the target it prints
    night = sync_or_record(SyncConfig(store=str(tmp_path / "store"), to=url, model=MODEL))
    assert night == {"target": url, "error": line.split(" failed: ", 1)[1]}
    assert _watermarks(tmp_path, url) == [1]


def test_an_engines_message_is_masked_and_cut_to_one_line(monkeypatch):
    """What an engine says can quote anything: a credential, a filter of a thousand ids over many lines."""
    secret = "milvus-token-" + os.urandom(6).hex()
    monkeypatch.setenv("MILVUS_TOKEN", secret)
    said = RuntimeError(f"auth failed for root:{secret}\n" + "item_id in [" + ", ".join(['"x"'] * 5000) + "]")
    error = target_failed(parse_target("milvus://milvus.internal:19530/products"), "batch 3 of 9 (deleting)", said)
    text = str(error)
    assert secret not in text and "\n" not in text and len(text) < 700
    assert text.startswith("sync to milvus://milvus.internal:19530/products failed: batch 3 of 9 (deleting): "
                           "RuntimeError: auth failed for root:***")


HOLDER = """
import sys, time
from pymilvus import MilvusClient
client = MilvusClient(uri=sys.argv[1])  # as a notebook does: open, look, close
client.list_collections()
client.close()  # the file stays held until the process releases Milvus Lite's server or exits
print("held", flush=True)
time.sleep(600)
"""


def test_a_milvus_lite_file_open_in_another_process_is_one_line_saying_so(tmp_path, synced_store):
    url = _url("milvus", tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, parse_target(url).where], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        held = _sync_process(tmp_path, url)
    finally:
        holder.kill()
        holder.wait()
    assert held.returncode == 1, held.stdout
    assert "Traceback" not in held.stdout and "Failed to start" not in held.stdout
    assert len(_errors(held.stdout)) == 1, held.stdout
    [line] = _errors(held.stdout)
    assert line.startswith(f"imgest: sync to {url} failed: the Milvus Lite file {parse_target(url).where} is "
                           "open in another process"), line
    assert "one process at a time" in line and "close it there, or sync to a Milvus server" in line
    assert _watermarks(tmp_path, url) == []
    again = _sync_cli(tmp_path, url)  # once it is closed there, the next sync catches up
    assert again.exit_code == 0 and "30 item(s) upserted" in again.output, again.output


@pytest.mark.parametrize("debug", ["", "--debug", "IMGEST_DEBUG=1"])
def test_an_error_nothing_foresaw_is_one_line_and_its_traceback_is_asked_for(debug, tmp_path, synced_store,
                                                                             monkeypatch):
    """Qdrant's local mode serves its folder to one client: a notebook holding it makes the sync fail with the
    client's own RuntimeError, which imgest does not translate; the last resort of every command says it in one
    line, exit 1; the traceback (masked) when asked for, with the option or the variable."""
    from qdrant_client import QdrantClient

    url = _url("qdrant", tmp_path)
    monkeypatch.delenv("IMGEST_DEBUG", raising=False)
    notebook = QdrantClient(path=parse_target(url).where)
    try:
        result = _sync_process(tmp_path, url, *([debug] if debug.startswith("--") else []),
                               env={"IMGEST_DEBUG": "1"} if debug.startswith("IMGEST_DEBUG") else None)
    finally:
        notebook.close()
    assert result.returncode == 1, result.stdout
    [line] = _errors(result.stdout)
    assert line.startswith("imgest: sync failed: RuntimeError: Storage folder ") and \
        "already accessed by another instance of Qdrant client" in line, line
    assert ("Traceback (most recent call last)" in result.stdout) == bool(debug), result.stdout
    if debug:
        assert result.stdout.splitlines()[-1] == line  # the line comes last, after the traceback
    else:
        assert line.endswith("(--debug or IMGEST_DEBUG=1 shows the traceback)")
