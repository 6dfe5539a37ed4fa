"""One odd object never breaks a run; a run that would tombstone most of the catalogue stops before writing;
items that come back are revived, not re-encoded. Real files, real Prefect runs, the raw-pixel encoder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from imgest.config import MigrateConfig, NightlyConfig
from imgest.flows.ingest import ingest
from imgest.state.committed import FAILED, LIVE, REJECTED, CatalogueState, ItemState, load_state
from imgest.storage import Location, StorageError, is_transient
from imgest.tasks.ingest.encode import prepare
from imgest.tasks.ingest.plan import MassDeleteError, WorkItem, item_key, plan_ingest
from tests.helpers import gradient, ingest_into, live_rows, png_bytes, write_files

MODEL = "raw-pixels"


def _ingest(cat, store, **kw):
    kw.setdefault("batch_size", "4")
    return ingest_into(cat, store, model=MODEL, **kw)


def _images(n: int, offset: int = 0) -> dict[str, bytes]:
    return {f"p/{i:03d}.png": png_bytes(gradient(offset + i)) for i in range(n)}


# -- per-object faults ------------------------------------------------------------------------------------
@pytest.mark.usefixtures("prefect_harness")
def test_a_key_that_is_not_utf8_is_rejected_and_the_six_good_images_go_live(tmp_path):
    cat = tmp_path / "cat"
    write_files(str(cat), _images(6))
    with open(os.path.join(os.fsencode(cat / "p"), b"caf\xe9.png"), "wb") as fh:  # Latin-1 bytes in the name
        fh.write(png_bytes(gradient(99)))
    summary = _ingest(cat, tmp_path / "store")
    assert (summary["listed"], summary["encoded"], summary["rejected"]) == (7, 6, 1)
    (item_id, reason), = summary["rejected_items"]
    assert item_id == "p/caf\\xe9.png" and "not valid UTF-8" in reason
    again = _ingest(cat, tmp_path / "store")  # permanent: not read again until the object changes
    assert (again["encoded"], again["rejected"], again["unchanged"]) == (0, 0, 7)


@pytest.mark.usefixtures("prefect_harness")
def test_an_unreadable_object_is_recorded_against_it_and_the_run_goes_on(tmp_path):
    cat = tmp_path / "cat"
    write_files(str(cat), _images(3))
    os.symlink("/proc/self/mem", cat / "p" / "bad.png")  # a regular file whose every read fails (EINVAL)
    summary = _ingest(cat, tmp_path / "store")
    assert (summary["encoded"], summary["rejected"], summary["failed"]) == (3, 1, 0)
    assert summary["rejected_items"][0][0] == "p/bad.png" and "OSError" in summary["rejected_items"][0][1]
    state = load_state(Location(str(tmp_path / "store")), _slug())
    assert state.items["p/bad.png"].status == REJECTED and state.count(LIVE) == 3


@pytest.mark.usefixtures("prefect_harness")
def test_objects_over_max_bytes_are_rejected_from_their_listing(tmp_path):
    cat = tmp_path / "cat"
    files = _images(3)
    write_files(str(cat), files)
    limit = max(len(b) for b in files.values()) - 1
    summary = _ingest(cat, tmp_path / "store", max_bytes=limit)
    too_big = sorted(k for k, b in files.items() if len(b) > limit)
    assert sorted(i for i, _ in summary["rejected_items"]) == too_big
    assert all(r.startswith("TooLarge: ") for _, r in summary["rejected_items"])


@pytest.mark.usefixtures("prefect_harness")  # the CLI run reports to the session's server
def test_fifos_and_device_links_are_skipped_not_read(tmp_path):
    """A FIFO blocks a reader for ever and /dev/zero never ends: listed, counted, never opened. The ingest
    runs in its own process with a deadline, so a regression fails here instead of hanging the suite."""
    cat, store = tmp_path / "cat", tmp_path / "store"
    write_files(str(cat), _images(2))
    os.mkfifo(cat / "p" / "pipe.png")
    os.symlink("/dev/zero", cat / "p" / "zero.png")
    os.symlink(cat / "p" / "000.png", cat / "p" / "link.png")  # a link to a regular file is followed
    imgest = os.path.join(os.path.dirname(sys.executable), "imgest")
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home")}
    from prefect.settings import PREFECT_API_URL

    env["PREFECT_API_URL"] = PREFECT_API_URL.value()  # the session's server: no ephemeral one to start
    out = subprocess.run([imgest, "ingest", "--catalogue", str(cat), "--store", str(store), "--model", MODEL,
                          "--json"], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert (summary["listed"], summary["not_regular"], summary["encoded"]) == (3, 2, 3)


def test_store_inside_its_catalogue_is_refused(tmp_path):
    from typer.testing import CliRunner

    from imgest.cli import app

    write_files(str(tmp_path / "cat"), _images(1))
    result = CliRunner().invoke(app, ["ingest", "--catalogue", str(tmp_path / "cat"), "--store",
                                      str(tmp_path / "cat" / "store"), "--model", MODEL])
    assert result.exit_code == 2 and "overlap" in result.output, result.output


def test_a_transient_failure_is_retried_next_run_a_permanent_one_only_on_change(tmp_path):
    """MemoryError while decoding is the moment's (failed, read again next run); a decode error is the
    object's (rejected until its bytes change)."""
    cat = Location(str(tmp_path))
    write_files(str(tmp_path), {"a.png": png_bytes(gradient(1)), "b.png": b"\x89PNG broken"})
    item = lambda key: WorkItem(key, cat.uri(key), 1, 1.0, None, None)  # noqa: E731

    def no_memory(image):
        raise MemoryError("cannot allocate 4 GiB")

    failed = prepare(cat, item("a.png"), no_memory, 10**8)
    broken = prepare(cat, item("b.png"), lambda image: image, 10**8)
    assert failed.transient and failed.reason.startswith("MemoryError")
    assert not broken.transient and "UnidentifiedImageError" in broken.reason

    from imgest.images.listing import list_catalogue

    listing = list_catalogue(str(tmp_path))
    state = CatalogueState("s", {})
    for obj in listing.objects:
        status = FAILED if obj.key == "a.png" else REJECTED
        state.items[obj.key] = ItemState(obj.key, cat.uri(obj.key), status, None, obj.size, obj.mtime, None)
    plan = plan_ingest(listing, state, "r00000002-x-y", 10)
    assert [i.item_id for s in plan.shards for i in s.items] == ["a.png"] and plan.retried == 1


def test_transient_faults_are_told_from_permanent_ones():
    import botocore.exceptions as bx

    slow = bx.ClientError({"Error": {"Code": "SlowDown", "Message": "reduce your request rate"}}, "GetObject")
    denied = bx.ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "GetObject")
    for exc, transient in ((slow, True), (bx.ReadTimeoutError(endpoint_url="http://x"), True),
                           (bx.EndpointConnectionError(endpoint_url="http://x"), True), (TimeoutError(), True),
                           (MemoryError(), True), (denied, False), (PermissionError(13, "denied"), False),
                           (OSError(22, "Invalid argument"), False)):
        wrapped = StorageError("s3://b: reading k failed")
        wrapped.__cause__ = exc
        assert is_transient(wrapped) is transient, exc


def test_the_retry_backoff_is_the_operators_and_a_bad_value_is_named(monkeypatch):
    from imgest.policy import backoff_base

    monkeypatch.setenv("IMGEST_RETRY_BACKOFF_S", "0.5")
    assert backoff_base() == 0.5
    monkeypatch.delenv("IMGEST_RETRY_BACKOFF_S")
    assert backoff_base() == 2.0
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv("IMGEST_RETRY_BACKOFF_S", bad)
        with pytest.raises(ValueError, match="IMGEST_RETRY_BACKOFF_S"):
            backoff_base()


def test_item_keys_are_the_keys_or_a_printable_stand_in():
    assert item_key("shoes/red sneaker #1+.jpg") == "shoes/red sneaker #1+.jpg"
    assert item_key(os.fsdecode(b"caf\xe9.jpg")) == "caf\\xe9.jpg"


# -- mass deletion and revival ---------------------------------------------------------------------------
@pytest.mark.usefixtures("prefect_harness")
def test_a_mass_deletion_stops_before_writing_and_returning_items_are_revived(tmp_path):
    cat, store, away = tmp_path / "cat", tmp_path / "store", tmp_path / "away"
    write_files(str(cat), _images(10))
    _ingest(cat, store)
    before, runs = live_rows(store, MODEL), sorted(os.listdir(store / "runs"))
    snapshots = sorted(os.listdir(store / "state" / f"model={_slug()}" / "snapshots"))
    away.mkdir()
    for i in range(2, 10):  # 8 of 10 vanish: a half-synced bucket
        shutil.move(cat / "p" / f"{i:03d}.png", away / f"{i:03d}.png")

    with pytest.raises(MassDeleteError, match=r"would tombstone 8 of 10 live items \(80%, over the allowed 20%\)"):
        _ingest(cat, store)
    assert live_rows(store, MODEL) == before and sorted(os.listdir(store / "runs")) == runs  # nothing changed
    assert sorted(os.listdir(store / "state" / f"model={_slug()}" / "snapshots")) == snapshots

    deleted = _ingest(cat, store, allow_mass_delete=True)  # the operator confirms
    assert deleted["deleted"] == 8 and set(live_rows(store, MODEL)) == {"p/000.png", "p/001.png"}

    for name in os.listdir(away):  # they come back, same bytes
        shutil.move(away / name, cat / "p" / name)
    back = _ingest(cat, store)
    assert (back["new"], back["revived"], back["encoded"]) == (8, 8, 0)  # no image decoded or encoded
    assert live_rows(store, MODEL) == before  # same ids, hashes and embeddings as before the deletion


@pytest.mark.usefixtures("prefect_harness")
def test_an_empty_listing_over_live_items_stops(tmp_path):
    cat, store = tmp_path / "cat", tmp_path / "store"
    write_files(str(cat), _images(3))
    _ingest(cat, store)
    for name in os.listdir(cat / "p"):
        os.remove(cat / "p" / name)
    with pytest.raises(MassDeleteError, match="from an empty listing"):
        _ingest(cat, store)
    assert len(live_rows(store, MODEL)) == 3


def _slug() -> str:
    from imgest.encoders import resolve

    return resolve(MODEL).slug


# -- the nightly follows the serving model -----------------------------------------------------------------
@pytest.mark.usefixtures("prefect_harness")
def test_after_a_finished_migration_the_nightly_follows_serving_and_never_reencodes_the_retired_model(
        tmp_path, tiny_models):
    from imgest.encoders import resolve
    from imgest.flows.migrate import migrate
    from imgest.flows.nightly import nightly

    cat, store = tmp_path / "cat", tmp_path / "store"
    write_files(str(cat), _images(12))
    first = nightly(NightlyConfig(catalogue=str(cat), store=str(store),
                                  batch_size="4"))  # a new store: the default model
    assert [r["ingest"]["model_id"].split("@")[0] for r in first["models"]] == ["efficientnet-lite0"]
    new = f"hf:{tiny_models['dinov2']}"
    migrate(MigrateConfig(store=str(store), action="start", to=new, batch_size="4"))
    migrate(MigrateConfig(store=str(store), action="promote", force="retirement test: no evaluation"))
    migrate(MigrateConfig(store=str(store), action="finish", retain_days=0))
    old_slug, new_slug = first["models"][0]["ingest"]["slug"], resolve(new).slug
    assert not (store / "embeddings" / f"model={old_slug}").exists()

    write_files(str(cat), _images(2, offset=500) | {})  # two new images, keys p/000-001 changed
    night = nightly(NightlyConfig(catalogue=str(cat), store=str(store),
                                  batch_size="4"))  # the deployment: no model given
    assert [r["ingest"]["slug"] for r in night["models"]] == [new_slug]
    assert night["models"][0]["ingest"]["encoded"] == 2 and night["models"][0]["index"]["card"]["n"] == 12

    old_param = nightly(NightlyConfig(catalogue=str(cat), store=str(store), model="efficientnet-lite0", batch_size="4"))
    assert [r["ingest"]["slug"] for r in old_param["models"]] == [new_slug]
    assert "retired by a finished migration window" in old_param["left_out"][0]
    assert not (store / "embeddings" / f"model={old_slug}").exists(), "the retired model is not re-encoded"


# -- nothing secret in any output ---------------------------------------------------------------------------
def test_presigned_signatures_and_sas_tokens_are_redacted():
    from imgest.storage import redact

    presigned = ("https://bucket.s3.amazonaws.com/shoes/1.jpg?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential="
                 "AKIAEXAMPLE%2F20261130&X-Amz-Signature=0123456789abcdef")
    sas = "https://acct.blob.core.windows.net/c/1.jpg?sv=2024-01-01&se=2026-12-01&sig=SAS%2Bsecret%3D"
    for url, secrets in ((presigned, ("AKIAEXAMPLE", "0123456789abcdef")), (sas, ("SAS%2Bsecret", "2024-01-01"))):
        text = redact(f"reading {url} failed: 403")
        assert not any(secret in text for secret in secrets), text
        assert url.split("?")[0] in text  # the object is still named
    assert redact("az://c/b.jpg?sig=abc&se=x") == "az://c/b.jpg?sig=***&se=***"


def test_urls_with_credentials_are_refused_before_anything_runs(tmp_path):
    from typer.testing import CliRunner

    from imgest.cli import app

    write_files(str(tmp_path / "cat"), _images(1))
    for args in (["ingest", "--catalogue", "s3://AKIAUSER:TopSecret123@bucket/products", "--store", str(tmp_path)],
                 ["nightly", "--catalogue", str(tmp_path / "cat"), "--store", "s3://AKIAUSER:TopSecret123@b/s"],
                 ["build-index", "--store", "s3://AKIAUSER:TopSecret123@b/s"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output
        assert "TopSecret123" not in result.output and "AKIAUSER" not in result.output
        assert "AWS_ACCESS_KEY_ID" in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.usefixtures("prefect_harness")
def test_a_flow_run_given_a_credential_url_fails_at_validation_without_the_secret(tmp_path):
    """As a deployment passes it (plain JSON): Prefect validates the config, the refusal masks the secret."""
    from prefect.exceptions import ParameterTypeError

    with pytest.raises(ParameterTypeError, match="catalogue s3://\\*\\*\\*@bucket/products is refused") as refused:
        ingest(config={"catalogue": "s3://AKIAUSER:TopSecret123@bucket/products", "store": str(tmp_path / "store"),
                       "model": MODEL})
    assert "TopSecret123" not in str(refused.value) and not (tmp_path / "store").exists()


@pytest.mark.slow("an HTTP server")
def test_a_query_image_behind_a_signed_url_is_named_without_its_signature():
    """An http query image that cannot be read: the error names the object, never the signature."""
    import http.server
    import threading

    from imgest.storage import read_url

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_error(404)

        def do_HEAD(self):  # noqa: N802
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/q.jpg?X-Amz-Signature=deadbeefcafe&X-Amz-Credential=AKIAQ"
    try:
        with pytest.raises(StorageError) as failed:
            read_url(url)
    finally:
        server.shutdown()
    message = str(failed.value)
    assert f"127.0.0.1:{server.server_port}/q.jpg" in message, message
    assert "deadbeefcafe" not in message and "AKIAQ" not in message, message


def test_the_promote_gate_refuses_evidence_about_other_index_versions():
    from imgest.tasks.migration.window import MigrationError, check_gate

    gate = {"metric": "recall@10",
            "a": {"alias": "serving", "slug": "old-1", "version": 3, "metrics": {"recall@10": 0.80}},
            "b": {"alias": "shadow", "slug": "new-2", "version": 2, "metrics": {"recall@10": 0.85}}}
    now = {"serving": {"slug": "old-1", "version": 3}, "shadow": {"slug": "new-2", "version": 2}}
    assert check_gate(gate, 0.0, now) is None  # shadow better, versions as measured
    rebuilt = {**now, "shadow": {"slug": "new-2", "version": 3}}  # a nightly rebuilt shadow since
    with pytest.raises(MigrationError, match="measured shadow = model=new-2 v2, but it now points at model=new-2 v3"):
        check_gate(gate, 0.0, rebuilt)


@pytest.mark.usefixtures("prefect_harness")
def test_an_archived_object_is_rejected_from_its_listing_on_s3(tmp_path, s3_each_endpoint):
    import boto3
    import s3fs

    s3_endpoint = s3_each_endpoint  # on each server: what a listing says of a storage class is where they differ

    bucket = f"archive-{os.urandom(3).hex()}"
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}).mkdir(bucket)
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    for key, data in _images(3).items():
        client.put_object(Bucket=bucket, Key=f"cat/{key}", Body=data)
    client.put_object(Bucket=bucket, Key="cat/p/cold.png", Body=png_bytes(gradient(7)), StorageClass="GLACIER")
    summary = _ingest(f"s3://{bucket}/cat", tmp_path / "store")
    assert (summary["encoded"], summary["rejected"]) == (3, 1)
    assert tuple(summary["rejected_items"][0]) == ("p/cold.png", "ArchivedObject: storage class GLACIER cannot be read "
                                                                 "until it is restored")


@pytest.mark.usefixtures("prefect_harness")
def test_the_mass_delete_refusal_is_one_line_and_exit_2(tmp_path):
    from typer.testing import CliRunner

    from imgest.cli import app

    cat, store = tmp_path / "cat", tmp_path / "store"
    write_files(str(cat), _images(5))
    _ingest(cat, store)
    for i in range(1, 5):
        os.remove(cat / "p" / f"{i:03d}.png")
    result = CliRunner().invoke(app, ["ingest", "--catalogue", str(cat), "--store", str(store), "--model", MODEL])
    assert result.exit_code == 2, result.output
    line, = result.output.strip().splitlines()
    assert "would tombstone 4 of 5 live items" in line and "--allow-mass-delete" in line
