"""The command line: one-line reasons and exit code 2 on bad input, before any work starts."""

import pytest
from typer.testing import CliRunner

from imgest.cli import app
from tests.s3servers import KEY_ID, SECRET

runner = CliRunner()


def _ingest(*args):
    return runner.invoke(app, ["ingest", *args])


def test_unknown_model(tmp_path):
    result = _ingest("--catalogue", str(tmp_path), "--store", str(tmp_path / "s"), "--model", "resnet9000")
    assert result.exit_code == 2
    known = ("known: efficientnet-lite0, efficientnet-lite0-gem, efficientnet-lite0-gem-ms, efficientnet-lite1, "
             "efficientnet-lite1-gem, efficientnet-lite1-gem-ms, efficientnet-lite2, efficientnet-lite2-gem, "
             "efficientnet-lite2-gem-ms, minilm-l6, hf:")
    assert f"unknown model 'resnet9000'; {known}" in result.output


def test_missing_catalogue(tmp_path):
    result = _ingest("--catalogue", str(tmp_path / "nope"), "--store", str(tmp_path / "s"))
    assert result.exit_code == 2 and "catalogue" in result.output and "does not exist" in result.output


def test_unreachable_s3_catalogue(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)  # with keys, as a user has them: the endpoint is what fails
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    result = _ingest("--catalogue", "s3://no-bucket/x", "--store", str(tmp_path / "s"))
    assert result.exit_code == 2 and "unreachable" in result.output
    assert SECRET not in result.output


def test_bad_store_url(tmp_path):
    result = _ingest("--catalogue", str(tmp_path), "--store", "nosuchproto://bucket/x")
    assert result.exit_code == 2 and "nosuchproto://bucket/x" in result.output


@pytest.mark.parametrize("flag,value,expected", [
    ("--batch-size", "big", "batch_size must be 'auto' or a positive integer"),
    ("--batch-size", "0", "batch_size must be 'auto' or a positive integer"),
    ("--device", "tpu", "device must be one of auto, cpu, cuda"),
    ("--shard-size", "0", "shard_size must be an integer >= 1"),
])
def test_bad_parameters_name_the_field(tmp_path, flag, value, expected):
    result = _ingest("--catalogue", str(tmp_path), "--store", str(tmp_path / "s"), flag, value)
    assert result.exit_code == 2 and expected in result.output


def test_status_and_export_of_unknown_model(tmp_path):
    (tmp_path / "store").mkdir()
    result = runner.invoke(app, ["export", "--store", str(tmp_path / "store"), "--model", "x", "--out",
                                 str(tmp_path / "o.parquet")])
    assert result.exit_code == 2 and "has no model 'x'; models in the store: none" in result.output
    result = runner.invoke(app, ["status", "--store", str(tmp_path / "store")])
    assert result.exit_code == 0 and "no models ingested yet" in result.output


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10", "search.example.com", "127.0.0.1.nip.io"])
def test_api_beyond_loopback_without_a_token_is_refused(tmp_path, monkeypatch, host):
    """The service shows every item's thumbnail and metadata to whoever reaches it: refused before the store is
    opened, in one line naming the variable and the opt-in."""
    monkeypatch.delenv("IMGEST_API_TOKEN", raising=False)
    result = runner.invoke(app, ["api", "--store", str(tmp_path / "no-store"), "--host", host])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        f"imgest: error: --host {host} is reachable from other machines and IMGEST_API_TOKEN is not set: anyone who "
        "reaches the service would see every item's thumbnail and metadata; set IMGEST_API_TOKEN (clients send "
        "Authorization: Bearer <token>), or pass --no-token on a trusted network"]


@pytest.mark.parametrize("host, token, no_token", [
    ("127.0.0.1", None, False), ("127.3.2.1", None, False), ("::1", None, False), ("localhost", None, False),
    ("::ffff:127.0.0.1", None, False), ("0.0.0.0", "a-token-value", False), ("0.0.0.0", None, True),
])
def test_api_on_loopback_with_a_token_or_with_no_token_goes_on(tmp_path, monkeypatch, host, token, no_token):
    """Loopback, a token set, or --no-token said: the command goes on to open the store (missing here, so it
    stops there, before anything listens)."""
    monkeypatch.delenv("IMGEST_API_TOKEN", raising=False)
    if token:
        monkeypatch.setenv("IMGEST_API_TOKEN", token)
    args = ["api", "--store", str(tmp_path / "no-store"), "--host", host, *(["--no-token"] if no_token else [])]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "IMGEST_API_TOKEN" not in result.output, result.output
    assert "no-store" in result.output and "does not exist" in result.output, result.output
