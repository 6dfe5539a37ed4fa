"""The ingest flow end to end under a real Prefect server: incremental runs, S3, kill -9, a second writer."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import duckdb
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from imgest.cli import app
from imgest.images import decoders
from imgest.retrieval.status import store_status
from imgest.state import layout
from imgest.state.export import export_live
from imgest.state.shards import shard_decoder
from tests.helpers import (
    HANG_AFTER_FIRST_SHARD,
    commit_markers,
    gradient,
    hostile_files,
    ingest_into,
    jpeg_bytes,
    png_bytes,
    small_catalogue,
    write_files,
)
from tests.s3servers import SECRET

pytestmark = pytest.mark.usefixtures("prefect_harness")
BAD = {"empty.jpg", "truncated.jpg", "not-an-image.png", "huge.png"}


def _run(catalogue, store, **kw):
    kw.setdefault("batch_size", "4")
    kw.setdefault("shard_size", 5)
    kw.setdefault("max_pixels", 100_000)
    return ingest_into(catalogue, store, **kw)


def _export_ids(store, out, model="efficientnet-lite0"):
    result = export_live(str(store), model, str(out))
    table = pq.read_table(out)
    ids = table.column("item_id").to_pylist()
    assert result["rows"] == len(ids) == len(set(ids)), "every live item exactly once"
    return table


def test_incremental_runs_add_change_touch_delete(tmp_path):
    cat, store = tmp_path / "catalogue", tmp_path / "store"
    files = {**small_catalogue(12), **{f"hostile/{k}": v for k, v in hostile_files().items()}}
    write_files(str(cat), {**files, "README.txt": b"not an image", "_SUCCESS": b""})

    first = _run(cat, store)
    images = len(files)
    assert (first["listed"], first["new"], first["skipped"]) == (images, images, 2)
    assert first["rejected"] == len(BAD) and first["encoded"] == images - len(BAD)
    assert {i.split("/")[-1] for i, _ in first["rejected_items"]} == BAD
    status = store_status(str(store))["models"][0]
    assert status["live"] == images - len(BAD) and status["tombstones"] == 0
    reasons = {r["item_id"]: r["reason"] for r in status["rejected"]}
    assert reasons["hostile/empty.jpg"].startswith("EmptyFile")
    assert reasons["hostile/huge.png"].startswith("DecompressionBombError")
    before = _export_ids(store, tmp_path / "one.parquet")

    # No change: nothing is read, decoded or encoded; the snapshot does not move.
    quiet = _run(cat, store)
    assert (quiet["new"], quiet["changed"], quiet["deleted"], quiet["encoded"], quiet["shards"]) == (0, 0, 0, 0, 0)
    assert quiet["unchanged"] == images and quiet["snapshot_seq"] == first["snapshot_seq"]

    # Add two, change one, touch one (same bytes, new mtime), delete one, fix one rejected file.
    write_files(str(cat), {"img/new-a.jpg": jpeg_bytes(gradient(900)), "img/new-b.jpg": jpeg_bytes(gradient(901)),
                           "img/0001.jpg": jpeg_bytes(gradient(555)), "hostile/empty.jpg": jpeg_bytes(gradient(3))})
    os.utime(cat / "img/0002.jpg", (time.time() + 50, time.time() + 50))
    os.remove(cat / "img/0003.jpg")
    third = _run(cat, store)
    assert (third["new"], third["changed"], third["deleted"], third["rejected"]) == (2, 2, 1, 0)
    assert third["encoded"] == 4 and third["unchanged"] == images - 1 - 2  # touched counts as unchanged

    after = _export_ids(store, tmp_path / "two.parquet")
    old = dict(zip(before.column("item_id").to_pylist(), before.column("embedding").to_pylist()))
    new = dict(zip(after.column("item_id").to_pylist(), after.column("embedding").to_pylist()))
    assert "img/0003.jpg" not in new and {"img/new-a.jpg", "img/new-b.jpg", "hostile/empty.jpg"} <= set(new)
    assert new["img/0001.jpg"] != old["img/0001.jpg"] and new["img/0002.jpg"] == old["img/0002.jpg"]
    status = store_status(str(store))["models"][0]
    assert status["live"] == len(new) and status["tombstones"] == 1 and len(status["rejected"]) == 3

    # The shard folder reads as is with pyarrow.dataset (hive partition) and DuckDB.
    shards = store / "embeddings"
    dataset = ds.dataset(str(shards), format="parquet", partitioning="hive")
    assert set(dataset.to_table(columns=["model"]).column("model").to_pylist()) == {status["slug"]}
    rows = duckdb.sql(f"select item_id, model_id, len(embedding) as d "
                      f"from read_parquet('{shards}/*/*.parquet', hive_partitioning=true)").fetchall()
    assert {d for _, _, d in rows} == {1280} and {m for _, m, _ in rows} == {status["model_id"]}
    meta = pq.read_schema(next(shards.glob("*/*.parquet"))).metadata
    assert meta[b"imgest.model_id"].decode() == status["model_id"] and meta[b"imgest.normalisation"] == b"l2"
    slug = status["slug"]  # the README's live view: newest snapshot row per item, joined to its shard's row
    live_view = duckdb.sql(f"""
        WITH s AS (SELECT * FROM read_parquet('{store}/state/model={slug}/snapshots/*.parquet', filename = true)
                   QUALIFY row_number() OVER (PARTITION BY item_id ORDER BY filename DESC) = 1)
        SELECT e.item_id FROM read_parquet('{store}/embeddings/model={slug}/*.parquet', filename = true) e
        JOIN s ON s.item_id = e.item_id AND s.status = 'live' AND e.filename LIKE '%/' || s.shard || '.parquet'
        """).fetchall()
    assert sorted(item for (item,) in live_view) == sorted(new)


def test_second_model_gets_its_own_namespace_and_auto_batch(tmp_path, tiny_models, host_measured_nothing,
                                                            monkeypatch):
    from imgest.tasks.ingest import batch_size

    monkeypatch.setattr(batch_size, "MIN_SECONDS", 0.1)  # how long each size is timed is not what is tested
    cat, store = tmp_path / "catalogue", tmp_path / "store"
    write_files(str(cat), small_catalogue(6))
    _run(cat, store)
    run = _run(cat, store, model=f"hf:{tiny_models['clip']}", batch_size="auto")
    assert run["encoded"] == 6 and run["batch_size_source"].startswith("auto, measured")
    models = {m["name"]: m for m in store_status(str(store))["models"]}
    assert len(models) == 2 and all(m["live"] == 6 for m in models.values())
    assert len({m["slug"] for m in models.values()}) == 2
    table = _export_ids(store, tmp_path / "clip.parquet", model=models[f"hf:{tiny_models['clip']}"]["slug"])
    assert table.schema.field("embedding").type.list_size == 24
    again = _run(cat, store, model=f"hf:{tiny_models['clip']}", batch_size="auto")
    assert again["encoded"] == 0 and again["batch_size_source"] == "nothing to encode"


def test_a_dinov2_shaped_model_decodes_product_photos_reduced_and_status_shows_its_side(tmp_path, monkeypatch):
    """A transformers DINOv2 whose processor resizes the shortest edge to 256 and crops 224 (facebook/dinov2-base's
    settings; tiny random weights): its ~1200 px JPEGs decode down to 256, not whole, once the reduced decode passes
    its gate against the processor's own path on whole images; the record, the shards and `imgest status` say so."""
    import torch
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    from imgest.encoders import parity
    from imgest.images.demo import product_photos

    folder = tmp_path / "models" / "dinov2-256"
    torch.manual_seed(0)
    Dinov2Model(Dinov2Config(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                             image_size=224, patch_size=14)).save_pretrained(folder)
    BitImageProcessor(size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224}, do_convert_rgb=True,
                      image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]).save_pretrained(folder)
    monkeypatch.setenv("IMGEST_MODEL_DIRS", str(folder.parent))
    sample = tuple(product_photos(24, seed=parity.SAMPLE_SEED).values())  # the gate's sample, not what is tested
    monkeypatch.setattr(parity, "_files", lambda: sample)
    cat, store = tmp_path / "catalogue", tmp_path / "store"
    write_files(str(cat), product_photos(4, seed=6, sides=(1100, 1300)))
    run = _run(cat, store, model=f"hf:{folder}", runtime="torch", precision="fp32", max_pixels=10**7)
    encoding = run["encoding"]
    assert run["encoded"] == 4 and (encoding["decoder"], encoding["decode_side"]) == (decoders.DEFAULT, 256)
    assert encoding["side_gate"]["passed"] and encoding["side_gate"]["images"] == 24
    assert {pq.read_schema(p).metadata[b"imgest.decode_side"] for p in (store / "embeddings").glob("*/*.parquet")} \
        == {b"256"}
    shown = CliRunner().invoke(app, ["status", "--store", str(store)]).output
    assert f"JPEG decode: {decoders.DEFAULT} (default, run {run['run_id']}), down to a shorter side of 256 px\n" \
        in shown, shown


def _s3(url: str):
    import s3fs

    return s3fs.S3FileSystem(client_kwargs={"endpoint_url": url})


def test_s3_catalogue_and_store(tmp_path, s3_endpoint, caplog):
    fs = _s3(s3_endpoint)
    fs.mkdir("catalogue-bucket")
    fs.mkdir("store-bucket")
    keys = ["shop/with space.jpg", "shop/ünï/ß.jpg", "shop/hash#1.JPG", "shop/q?.jpeg", "shop/plus+1.jpg"]
    for i, key in enumerate(keys):
        fs.pipe(f"catalogue-bucket/{key}", jpeg_bytes(gradient(i)))
    fs.pipe("catalogue-bucket/shop/.DS_Store", b"junk")
    cat, store = "s3://catalogue-bucket/shop", "s3://store-bucket/imgest"

    first = _run(cat, store)
    assert first["new"] == 5 and first["encoded"] == 5 and first["skipped"] == 1
    fs.pipe("catalogue-bucket/shop/hash#1.JPG", jpeg_bytes(gradient(77)))  # new bytes, new ETag
    fs.rm("catalogue-bucket/shop/q?.jpeg")
    second = _run(cat, store)
    assert (second["changed"], second["deleted"], second["unchanged"], second["encoded"]) == (1, 1, 3, 1)

    table = _export_ids(store, tmp_path / "live.parquet")
    assert sorted(table.column("item_id").to_pylist()) == sorted(k[5:] for k in keys if "q?" not in k)
    assert all(u.startswith("s3://catalogue-bucket/shop/") for u in table.column("uri").to_pylist())

    # Secrets never land in the store, the run summary or the logs.
    written = b"".join(fs.cat(p) for p in fs.find("store-bucket/imgest") if p.endswith(".json"))
    assert SECRET.encode() not in written and SECRET not in json.dumps(second) and SECRET not in caplog.text


def test_empty_catalogue_ingests_nothing(tmp_path):
    (tmp_path / "empty").mkdir()
    run = _run(tmp_path / "empty", tmp_path / "store")
    assert run["listed"] == 0 and run["encoded"] == 0


KILLABLE = HANG_AFTER_FIRST_SHARD + """
import sys
from imgest.flows.ingest import ingest
from imgest.images import decoders
ingest(config=dict(catalogue=sys.argv[1], store=sys.argv[2], batch_size="1", shard_size=4, runtime="torch",
                   precision="fp32"))
"""


def test_kill_mid_run_then_rerun_is_exactly_once_and_second_writer_refused(tmp_path):
    from prefect.settings import PREFECT_API_URL

    cat, store = tmp_path / "catalogue", tmp_path / "store"
    n = 80
    write_files(str(cat), {k: jpeg_bytes(gradient(i, (320, 240))) for i, k in enumerate(small_catalogue(n))})
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", KILLABLE, str(cat), str(store)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    commits = store / "state"
    deadline = time.time() + 120
    while time.time() < deadline and not commit_markers(commits, "model=*/commits/*.json"):
        assert proc.poll() is None, "ingest ended before committing a shard"
        time.sleep(0.02)

    # While it runs, a second ingest on the same store is refused with a clear message.
    refused = CliRunner().invoke(app, ["ingest", "--catalogue", str(cat), "--store", str(store)])
    assert refused.exit_code == 2 and "locked by run" in refused.output and "wait for it" in refused.output

    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not list(commits.glob("model=*/snapshots/*.parquet")), "killed before its snapshot"
    committed = sum(json.loads(p.read_text())["rows"] for p in commit_markers(commits, "model=*/commits/*.json"))
    assert 0 < committed < n

    # the killed run recorded the model's default decode before its first shard; the resume keeps it, times no
    # other, and every shard, the killed run's and its own, names it
    record = json.loads(next(commits.glob("model=*/decoder.json")).read_text())
    assert (record["how"], record["decoder"], record["side"]) == ("default", decoders.DEFAULT, 256)

    rerun = _run(cat, store, batch_size="4", shard_size=10, runtime="torch", precision="fp32")
    assert rerun["resumed_shards"] >= 1
    assert rerun["encoding"]["decoder"] == record["decoder"] and list(rerun["encoding"]["decoders"]) == \
        [record["decoder"]] and rerun["encoding"]["decoder_source"].startswith("recorded")
    assert {shard_decoder(pq.read_schema(p).metadata) for p in (store / "embeddings").glob("*/*.parquet")} == \
        {record["decoder"]}
    assert rerun["encoded"] == n - committed, "nothing committed before the kill is encoded again"
    table = _export_ids(store, tmp_path / "live.parquet")
    assert table.num_rows == n
    # No orphan or temp file is left where readers look: the folder read as is has each item once.
    names = [p.name for p in (store / "embeddings").glob("*/*")]
    assert all(name.startswith("part-") and name.endswith(".parquet") for name in names)
    rows = ds.dataset(str(store / "embeddings"), format="parquet").count_rows()
    assert rows == n
    # and the killed-and-resumed store holds a clean store's vectors (batch sizes differ: float noise only)
    clean = _run(cat, tmp_path / "clean", batch_size="4", shard_size=10, runtime="torch", precision="fp32")
    assert clean["encoding"]["decoder"] == record["decoder"] and clean["encoding"]["decode_side"] == 256
    resumed, fresh = (_vectors(_export_ids(s, tmp_path / f"{s.name}.parquet")) for s in (store, tmp_path / "clean"))
    assert resumed.keys() == fresh.keys() and max(abs(resumed[k] - fresh[k]).max() for k in fresh) < 1e-5


def test_a_catalogue_that_drops_mid_run_fails_the_run_naming_the_shard_and_the_object(tmp_path, s3_endpoint,
                                                                                       monkeypatch):
    """A store-wide fault (the catalogue's endpoint gone after listing) is the run's: one line naming the
    shard and the object, nothing committed. One object failing alone is not (tests/test_faults.py)."""
    import s3fs

    import imgest.tasks.ingest.steps as listing_module  # where the listing task finds list_catalogue
    from imgest.tasks.ingest.encode import ShardFailedError
    from tests.helpers import TcpProxy

    host, port = s3_endpoint.removeprefix("http://").split(":")
    proxy = TcpProxy((host, int(port)))
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}).mkdir("dropping-catalogue")
    write_files_s3 = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})
    for i in range(3):
        write_files_s3.pipe(f"dropping-catalogue/ok/{i}.png", png_bytes(gradient(i)))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries would only make the test slower
    listed, parts_done, lock = listing_module.list_catalogue, [], threading.Lock()

    def list_then_drop(url, folder="", maxdepth=None):  # two parts: the top level, and folder ok/
        listing = listed(url, folder, maxdepth)
        with lock:
            parts_done.append(folder)
            if len(parts_done) == 2:
                proxy.cut()  # the network goes after the listing: every read now fails to connect
        return listing

    monkeypatch.setattr(listing_module, "list_catalogue", list_then_drop)
    try:
        with pytest.raises(ShardFailedError) as failed:
            _run("s3://dropping-catalogue", tmp_path / "store", shard_size=10, model="raw-pixels")
    finally:
        proxy.cut()
    message = str(failed.value)
    assert "\n" not in message and message.startswith("shard part-r00000001-") and "(3 objects) failed after retries" \
        in message, message
    assert "reading ok/0.png failed: EndpointConnectionError" in message, message
    assert SECRET not in message
    assert not list((tmp_path / "store").glob("state/model=*/snapshots/*")), "nothing committed"


def _vectors(table) -> dict:
    from imgest.state.shards import embedding_matrix

    return dict(zip(table.column("item_id").to_pylist(), embedding_matrix(table, 1280)))


def _timed_as(winner: str):
    """decoders.fastest with its figures forced: `winner` ten times cheaper than every other decoder."""
    def fastest(datas, work, names=None, rounds=2):
        names = list(names or decoders.timed())
        return (winner if winner in names else names[0]), {n: 0.001 if n == winner else 0.01 for n in names}
    return fastest


def test_two_fresh_stores_hold_the_same_vectors_however_the_decoders_timings_fall(tmp_path, monkeypatch):
    """Two stores of one catalogue and model, their first runs with the decoders' timings forced apart both ways
    (Pillow ten times cheaper, then simplejpeg): the same decode recorded, the same vectors, bit for bit."""
    from imgest.images.demo import product_photos

    cat = tmp_path / "catalogue"
    photos = product_photos(6, seed=4, sides=(500, 700))
    write_files(str(cat), photos)
    fixed = {"runtime": "torch", "precision": "fp32", "max_pixels": 10**7}
    runs, tables = {}, {}
    for winner in (decoders.PILLOW, "simplejpeg"):
        monkeypatch.setattr(decoders, "fastest", _timed_as(winner))
        runs[winner] = _run(cat, tmp_path / winner, **fixed)
        tables[winner] = _vectors(_export_ids(tmp_path / winner, tmp_path / f"{winner}.parquet"))
    records = [json.loads(next((tmp_path / w / "state").glob("model=*/decoder.json")).read_text()) for w in runs]
    assert {(r["decoder"], r["how"], r["side"]) for r in records} == {(decoders.DEFAULT, "default", 256)}
    assert {run["encoding"]["decoder_source"] for run in runs.values()} == {"the model's default, recorded"}
    pillow, simplejpeg = tables.values()
    assert pillow.keys() == simplejpeg.keys() == set(photos)
    assert all((pillow[k] == simplejpeg[k]).all() for k in photos)


def test_a_later_run_keeps_a_recorded_decoder_other_than_the_default_and_the_same_bytes_give_the_same_vector(
        tmp_path):
    """The model's record names a decoder other than the default, as a store whose first run timed the decoders
    recorded it (before the decoder was fixed, and before sides were recorded): every later run decodes with it,
    its side is recorded, status says it is not the default, and a copy of a photo gets its vector."""
    from imgest import encoders
    from imgest.images.demo import product_photos
    from imgest.storage import Location

    cat, store = tmp_path / "catalogue", tmp_path / "store"
    photos = product_photos(6, seed=4, sides=(500, 700))
    write_files(str(cat), photos)
    kept = "turbojpeg"
    slug = encoders.resolve("efficientnet-lite0").slug
    Location(str(store)).write_json(layout.decoder_key(slug), {"decoder": kept, "how": "measured",
                                                                 "run_id": "r00000000-test"})
    fixed = {"runtime": "torch", "precision": "fp32", "max_pixels": 10**7}
    first = _run(cat, store, **fixed)
    write_files(str(cat), {f"copy/{key}": data for key, data in photos.items()})  # the same bytes, new names
    later = _run(cat, store, **fixed)
    for run in (first, later):
        assert run["encoding"]["decoder"] == kept and list(run["encoding"]["decoders"]) == [kept]  # only its cost
        assert run["encoding"]["decoder_source"].startswith(f"recorded: {kept} (measured, run r00000000-test")
        assert run["encoding"]["decode_side"] == 256
    assert "its side as decoded before sides were recorded, recorded now" in first["encoding"]["decoder_source"]
    assert decoders.read_record(Location(str(store)), slug).side == 256
    assert later["new"] == len(photos) and later["encoded"] == len(photos)
    vectors = _vectors(_export_ids(store, tmp_path / "live.parquet"))
    cosines = [float(vectors[key] @ vectors[f"copy/{key}"]) for key in photos]
    assert min(cosines) >= 0.99999, cosines
    assert {shard_decoder(pq.read_schema(p).metadata) for p in (store / "embeddings").glob("*/*.parquet")} == {kept}
    decode = store_status(str(store))["models"][0]["decoder"]
    assert decode["side"] == 256 and not decode["default_decoder"]
    assert f"not the model's default ({decoders.DEFAULT})" in decode["describe"]


def test_an_explicit_decoder_is_recorded_in_the_run_and_its_shards_and_status_shows_the_mix(tmp_path):
    from imgest.config import IndexConfig
    from imgest.flows.build_index import build_index

    cat, store = tmp_path / "catalogue", tmp_path / "store"
    write_files(str(cat), small_catalogue(6))
    first = _run(cat, store)
    recorded = first["encoding"]["decoder"]
    assert first["encoding"]["decoder_source"] == "the model's default, recorded" and recorded == decoders.DEFAULT
    other = next(name for name in decoders.timed() if name != recorded)
    write_files(str(cat), small_catalogue(4, seed=1, prefix="more"))
    second = _run(cat, store, decoder=other, force_decoder="a test of the switch")
    assert second["encoding"]["decoder"] == other and second["encoding"]["decoder_gate"] == \
        {"forced": "a test of the switch"}
    assert second["encoding"]["decoder_source"] == f"explicit, forced past the gate against {recorded} (a test of " \
                                                   "the switch), recorded"
    assert json.loads((store / "runs" / f"{second['run_id']}.json").read_text())["encoding"]["decoder"] == other
    by_run = {}
    for path in (store / "embeddings").glob("*/*.parquet"):
        meta = pq.read_schema(path).metadata
        by_run.setdefault(meta[b"imgest.run_id"].decode(), set()).add(shard_decoder(meta))
    assert by_run == {first["run_id"]: {recorded}, second["run_id"]: {other}}
    build_index(IndexConfig(store=str(store), kind="flat"))
    report = store_status(str(store))
    assert report["serving"]["decoded_by"] == {recorded: 6, other: 4}
    assert report["models"][0]["decoder"]["describe"].startswith(
        f"{other} (forced, run {second['run_id']}, after {recorded}), down to a shorter side of 256 px; not the "
        "model's default")
    shown = CliRunner().invoke(app, ["status", "--store", str(store)]).output
    assert f"JPEGs decoded by: {recorded} 60.0%, {other} 40.0%" in shown and f"JPEG decode: {other} (forced" in shown
    # the next run, without --decoder, keeps the switched one
    write_files(str(cat), small_catalogue(2, seed=2, prefix="last"))
    assert _run(cat, store)["encoding"]["decoder"] == other


def test_a_gpu_that_auto_cannot_use_is_named_in_the_run_and_its_status(tmp_path, monkeypatch):
    from imgest.encoders import base

    gpu, driver = tmp_path / "nvidiactl", tmp_path / "version"
    gpu.write_bytes(b"")
    driver.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n")
    monkeypatch.setattr(base, "GPU_DEVICE_FILES", (str(gpu),))  # a host whose driver is there, and torch's CPU build
    monkeypatch.setattr(base, "NVIDIA_DRIVER", str(driver))
    cat, store = tmp_path / "catalogue", tmp_path / "store"
    write_files(str(cat), small_catalogue(3))
    summary = _run(cat, store, model="raw-pixels")
    assert summary["device"] == "cpu"
    assert summary["device_note"].startswith("a GPU is here (driver 535.104.05) but this run encodes on the CPU: torch")
    assert "is a CPU build" in summary["device_note"]
    shown = CliRunner().invoke(app, ["status", "--store", str(store)]).output
    assert f"device: {summary['device_note']}" in shown
