"""Secrets never leak: an AWS secret holding `/` and `+`, given in every way a user might (in the URL, the
environment, an AWS profile, a presigned URL, a Prefect block), is refused or used, and found nowhere afterwards:
not on the terminal, in the store, in Prefect's database (parameters, states, logs, artifacts, events), nor in
the run's temporary files."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import string
import subprocess
import sys
import time
from urllib.parse import quote, quote_plus

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from imgest.redact import redact, register_secret, url_secrets
from imgest.storage import StorageError, check_no_credentials
from tests.helpers import gradient, png_bytes
from tests.s3servers import KEY_ID as S3_KEY_ID
from tests.s3servers import SECRET as S3_SECRET

SECRET = "wJalr/XUtnFEMI+K7MDENG/bPxRfiCYEXAMPLEKEY"
KEY_ID = "AKIAIMGESTLEAKTEST01"


def forms(secret: str) -> tuple[str, ...]:
    """A secret as typed, percent-encoded, form-encoded, escaped in JSON or a repr: any of them is a leak."""
    return secret, quote(secret, safe=""), quote_plus(secret, safe=""), json.dumps(secret)[1:-1], repr(secret)[1:-1]


def assert_absent(text: str, *secrets: str, where: str) -> None:
    for secret in secrets:
        for form in forms(secret):
            assert form not in text, f"{form!r} leaked in {where}: ...{text[max(0, text.find(form) - 120):][:300]}"


# -- detection and masking, whatever the secret holds ----------------------------------------------------------
AWS_ALPHABET = string.ascii_letters + string.digits + "/+"  # AWS secret access keys
aws_secrets = st.text(AWS_ALPHABET, min_size=16, max_size=64)  # 16+: never a substring of the rest of a message
symbols = st.text(AWS_ALPHABET + "=@:?#'\"`<>", min_size=16, max_size=64)  # other passwords: any symbol
printable = st.text(string.printable.replace("\n", "").replace("\r", ""), min_size=16, max_size=64)

# (URL with {s} for the secret as typed, {e} percent-encoded; what must still be readable once redacted)
IN_USERINFO = [
    ("s3://AKIAEXAMPLE:{s}@bucket/shoes/1.jpg", "bucket/shoes/1.jpg"),
    ("s3a://AKIAEXAMPLE:{s}@bucket", "bucket"),
    ("gs://user:{s}@bucket/k", "bucket/k"),
    ("https://user:{s}@example.com:8443/k.jpg", "example.com:8443/k.jpg"),
    ("simplecache::s3://AKIAEXAMPLE:{s}@bucket/k", "bucket/k"),
    ("s3://AKIAEXAMPLE:{e}@bucket/k", "bucket/k"),
    ("https://{e}@example.com/k.jpg", "example.com/k.jpg"),  # a token as the user name
]
IN_QUERY = [
    ("https://bucket.s3.amazonaws.com/k.jpg?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={e}"
     "&X-Amz-Signature={e}", "bucket.s3.amazonaws.com/k.jpg"),
    ("https://bucket.s3.amazonaws.com/k.jpg?AWSAccessKeyId=AKIAEXAMPLE&Expires=1&Signature={e}",
     "bucket.s3.amazonaws.com/k.jpg"),
    ("https://storage.googleapis.com/b/k.jpg?X-Goog-Credential={e}&X-Goog-Signature={e}",
     "storage.googleapis.com/b/k.jpg"),
    ("https://acct.blob.core.windows.net/c/k.jpg?sv=2024-01-01&se=2026-12-01&sp=r&sig={e}",
     "acct.blob.core.windows.net/c/k.jpg"),
    ("s3://bucket/k.jpg?X-Amz-Security-Token={s}", "bucket/k.jpg"),
    ("s3://bucket/k.jpg?X-Amz-Signature={e}&X-Amz-Credential={s}", "bucket/k.jpg"),
    ("az://c/k.jpg?sv=2024-01-01&skoid=x&sig={e}", "c/k.jpg"),
    ("gs://b/k.jpg?access_token={s}", "b/k.jpg"),
    ("http://127.0.0.1:9000/b/k.jpg?token={e}", "127.0.0.1:9000/b/k.jpg"),
]
IN_TEXT = [  # how a URL reaches a message: as is, quoted, in a repr, in JSON
    "reading {} failed: 403",
    "cannot open '{}'",
    "Location({!r})",
    "parameters: {}",
]


def _message(context: str, url: str) -> str:
    if context == "parameters: {}":
        return context.format(json.dumps({"catalogue": url, "store": "s3://store/x"}))
    return context.format(url)


@settings(max_examples=300, deadline=None)
@given(secret=aws_secrets, case=st.sampled_from(IN_USERINFO + IN_QUERY), context=st.sampled_from(IN_TEXT))
def test_an_aws_secret_is_found_and_masked_in_every_position(secret, case, context):
    template, readable = case
    url = template.format(s=secret, e=quote(secret, safe=""))
    assert url_secrets(url), f"not refused: {url}"
    with pytest.raises(StorageError) as refused:
        check_no_credentials(url, "catalogue")
    for text in (redact(_message(context, url)), str(refused.value)):
        assert_absent(text, secret, where=text)
        assert readable in text, f"{readable!r} should still name the object: {text}"


@settings(max_examples=200, deadline=None)
@given(secret=symbols, template=st.sampled_from([t for t, _ in IN_USERINFO[:5]]), context=st.sampled_from(IN_TEXT))
def test_a_password_holding_any_symbol_is_masked_too(secret, template, context):
    url = template.format(s=secret)
    assert "credentials in the URL" in url_secrets(url)
    assert_absent(redact(_message(context, url)), secret, where=url)


@settings(max_examples=200, deadline=None)
@given(secret=printable, template=st.sampled_from([t for t, _ in IN_USERINFO[:5]]))
def test_a_url_parameter_is_refused_without_its_password_even_one_holding_spaces(secret, template):
    url = template.format(s=secret)
    with pytest.raises(StorageError) as refused:
        check_no_credentials(url, "store")
    masked = re.sub(r"[^/:]+:\{s\}", "***", template)  # s3://***@bucket/shoes/1.jpg
    assert str(refused.value).startswith(f"store {masked} is refused: it carries credentials in the URL, ")


@pytest.mark.parametrize("url", [
    "s3://bucket/shoes/me@2x.png",  # an @ in a key is not a user
    "s3://bucket/dir:x/me@2x.png",
    "http://127.0.0.1:9000/bucket/me%402x.png",  # a port is not a password
    "tcp://scheduler:8786",
    "file:///data/a:b@c.jpg",
    "/data/catalogue",
    "s3://bucket/k.jpg?versionId=3",
    "hf:openai/clip-vit-base-patch32",
])
def test_ordinary_urls_are_neither_refused_nor_masked(url):
    assert url_secrets(url) == []
    check_no_credentials(url)
    if "?" not in url:  # an http query string is masked whole; an s3 one only its signing parameters
        assert redact(f"reading {url} failed") == f"reading {url} failed"


def test_a_presigned_url_inside_another_urls_query_is_masked():
    inner = f"s3://bucket/k.jpg?X-Amz-Credential={KEY_ID}%2F2026&X-Amz-Signature={quote(SECRET, safe='')}"
    text = redact(f"redirect to az://c/x?next={quote(inner, safe='')} failed")
    assert "XUtnFEMI" not in text and KEY_ID not in text, text
    assert text.startswith("redirect to az://c/x?next=s3%3A%2F%2Fbucket%2Fk.jpg%3FX-Amz-Credential%3D***%26"), text


def test_a_signed_url_read_once_may_be_allowed_but_never_a_password():
    """signed_ok: a presigned query image read once is fine; credentials before the host never are."""
    presigned = "https://b.s3.amazonaws.com/q.jpg?X-Amz-Credential=AKIA%2F2026&X-Amz-Signature=" + quote(SECRET, "")
    check_no_credentials(presigned, signed_ok=True)
    with pytest.raises(StorageError, match="X-Amz-Credential, the secret query parameter X-Amz-Signature"):
        check_no_credentials(presigned)
    with pytest.raises(StorageError, match="credentials in the URL"):
        check_no_credentials(f"s3://{KEY_ID}:{SECRET}@bucket/q.jpg", signed_ok=True)


def test_an_at_after_a_port_is_read_as_a_password():
    """`http://AKIA:7/abc@host/x` and `http://host:7/abc@2x.png` are the same text: the safe reading wins."""
    assert url_secrets("http://127.0.0.1:9000/bucket/me@2x.png") == ["credentials in the URL"]
    assert redact("http://127.0.0.1:9000/bucket/me@2x.png") == "http://***@2x.png"


def test_credential_variables_and_profiles_are_masked_in_every_encoding(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", "FwoGZXIvYXdzE+session/token==")
    profile_secret = "pr0file/Secret+Key/holding+both" + "x" * 10
    (tmp_path / "credentials").write_text(f"[default]\naws_access_key_id = AKIADEFAULT0000\n"
                                          f"aws_secret_access_key = {profile_secret}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))  # absent: skipped
    block_secret = "bl0ck/Secret+registered+at+run+time"
    register_secret(block_secret)
    for secret in (SECRET, "FwoGZXIvYXdzE+session/token==", profile_secret, block_secret):
        for form in forms(secret):
            text = redact(f"signature mismatch for {form}; X-Header: {form}")
            assert_absent(text, secret, where=text)
    # a rotated profile is read again
    (tmp_path / "credentials").write_text("[default]\naws_secret_access_key = rotated/Key+value0123\n")
    os.utime(tmp_path / "credentials", ns=(time.time_ns() + 10**9,) * 2)
    assert redact("rotated/Key+value0123 leaked") == "*** leaked"


def test_a_traceback_logged_by_a_run_logger_is_masked_with_its_chained_exceptions():
    import io
    import logging

    from imgest.redact import redact_logging

    logger = logging.getLogger("prefect.task_runs.imgest-test")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    url = f"https://bucket.s3.amazonaws.com/q.jpg?X-Amz-Signature={quote(SECRET, safe='')}"
    try:
        redact_logging(("prefect.task_runs.imgest-test",))
        try:
            try:
                raise OSError(f"404, message='Not Found', url='{url}'")  # what aiohttp says
            except OSError as exc:
                raise StorageError(f"reading {redact(url)} failed") from exc
        except StorageError:
            logger.exception("Task run failed with exception %r", url)
    finally:
        logger.removeHandler(handler)
    logged = stream.getvalue()
    assert "404, message='Not Found'" in logged and "bucket.s3.amazonaws.com/q.jpg" in logged, logged
    assert_absent(logged, SECRET, where=logged)


# -- every URL a flow takes is refused before Prefect sees it ------------------------------------------------------
def _configs():
    from imgest import config

    return [
        (config.IngestConfig, dict(catalogue="/c", store="/s"), ("catalogue", "store", "metadata", "inventory")),
        (config.NightlyConfig, dict(catalogue="/c", store="/s"), ("catalogue", "store", "metadata")),
        (config.IndexConfig, dict(store="/s"), ("store",)),
        (config.MigrateConfig, dict(store="/s", action="status"), ("store", "catalogue")),
        (config.EvalConfig, dict(store="/s", queries="/q.jsonl"), ("store", "queries", "out")),
        (config.DuplicatesConfig, dict(store="/s"), ("store",)),
        (config.TrainHeadConfig, dict(store="/s"), ("store", "labels", "eval_queries")),
    ]


def test_every_url_parameter_of_every_flow_config_is_refused_in_one_line():
    from pydantic import ValidationError

    from imgest.config import ConfigError, build

    presigned = "https://b.s3.amazonaws.com/m.csv?X-Amz-Credential=AKIA%2F2026&X-Amz-Signature=" + quote(SECRET, "")
    for cls, base, fields in _configs():
        for name in fields:
            for url in (f"s3://{KEY_ID}:{SECRET}@bucket/{name}", presigned):
                with pytest.raises(ValidationError) as raw:  # as Prefect sees it: the input is not echoed
                    cls(**{**base, name: url})
                assert_absent(str(raw.value), SECRET, KEY_ID, where=f"{cls.__name__}.{name}")
                with pytest.raises(ConfigError) as refused:  # as the command line prints it
                    build(cls, {**base, name: url})
                message = str(refused.value)
                assert_absent(message, SECRET, KEY_ID, where=f"{cls.__name__}.{name}")
                assert message.startswith(f"{name} ") and "\n" not in message, message
                assert "AWS_PROFILE" in message and "AwsCredentials" in message, message


# -- end to end: the terminal, the store, Prefect's database --------------------------------------------------------
def _prefect_database() -> str:
    from prefect.settings import get_current_settings

    url = get_current_settings().server.database.connection_url.get_secret_value()
    assert url.startswith("sqlite"), f"the test harness runs on SQLite, not {url.split(':')[0]}"
    return url.split(":///", 1)[1]


def _database_rows(path: str) -> list[tuple[str, str, str]]:
    """(table, column, text) of every text or blob cell of Prefect's database."""
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = []
        for (table,) in con.execute("select name from sqlite_master where type = 'table'"):
            columns = [c[1] for c in con.execute(f"pragma table_info('{table}')")]
            for row in con.execute(f"select * from '{table}'"):
                rows += [(table, c, v.decode("latin-1") if isinstance(v, bytes) else v)
                         for c, v in zip(columns, row) if isinstance(v, str | bytes)]
        return rows
    finally:
        con.close()


def _cli(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    """The installed `imgest` command, as a user runs it: its terminal output is what it printed."""
    imgest = os.path.join(os.path.dirname(sys.executable), "imgest")
    return subprocess.Popen([imgest, *args], env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
    """Exit code, stdout, and both streams together (the terminal)."""
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, out + err


@pytest.mark.usefixtures("prefect_harness")
def test_a_secret_given_every_way_appears_nowhere(tmp_path, s3_endpoint):
    import s3fs
    from prefect.settings import PREFECT_API_URL

    key_id, secret = S3_KEY_ID, S3_SECRET  # keys the S3 servers know (SeaweedFS checks them); the secret holds / and +
    bucket = f"secrets-{os.urandom(3).hex()}"
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})
    fs.mkdir(bucket)
    for i in range(3):
        fs.pipe(f"{bucket}/cat/p/{i}.png", png_bytes(gradient(i)))
    catalogue, store = f"s3://{bucket}/cat", f"s3://{bucket}/store"
    (tmp_path / "tmp").mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "PYTHONPATH"}
    base.update(PREFECT_API_URL=PREFECT_API_URL.value(), PYTHONPATH=os.getcwd(), AWS_ENDPOINT_URL=s3_endpoint,
                AWS_EC2_METADATA_DISABLED="true", AWS_DEFAULT_REGION="us-east-1", TMPDIR=str(tmp_path / "tmp"),
                PREFECT_HOME=str(tmp_path / "prefect-home"), AWS_CONFIG_FILE=str(tmp_path / "absent"),
                AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "absent"))
    run = ["ingest", "--catalogue", catalogue, "--store", store, "--model", "raw-pixels", "--batch-size", "4"]
    presigned = (f"https://{bucket}.s3.amazonaws.com/meta.csv?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential="
                 f"{key_id}%2F20261201%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Signature={quote(secret, safe='')}")

    # In the URL, or a presigned --metadata: refused by the command before a run exists, one line, exit 2.
    refusals = [_cli(["ingest", "--catalogue", f"s3://{key_id}:{secret}@{bucket}/cat", "--store", store], base),
                _cli(["nightly", "--catalogue", catalogue, "--store", store, "--metadata", presigned], base)]
    for proc in refusals:
        code, _, output = _finish(proc)
        assert code == 2 and len(output.strip().splitlines()) == 1, output
        assert "is refused" in output and "AWS_ACCESS_KEY_ID" in output and "AwsCredentials" in output, output
        assert_absent(output, secret, key_id, where="the terminal")

    # Through the environment: the run works against the loopback S3.
    env_vars = {**base, "AWS_ACCESS_KEY_ID": key_id, "AWS_SECRET_ACCESS_KEY": secret}
    code, summary, output = _finish(_cli([*run, "--json"], env_vars))
    assert code == 0, output
    assert json.loads(summary)["encoded"] == 3
    assert_absent(output, secret, key_id, where="the terminal")

    # Through an AWS profile, nothing in the environment (botocore sends no unsigned request: the profile is read).
    (tmp_path / "credentials").write_text(f"[imgest-test]\naws_access_key_id = {key_id}\n"
                                          f"aws_secret_access_key = {secret}\n")
    fs.pipe(f"{bucket}/cat/p/3.png", png_bytes(gradient(3)))
    profile = {**base, "AWS_PROFILE": "imgest-test", "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials")}
    code, summary, output = _finish(_cli([*run, "--json"], profile))
    assert code == 0, output
    assert json.loads(summary)["encoded"] == 1
    assert_absent(output, secret, key_id, where="the terminal")

    # The store: every object, records, shards and artifacts alike.
    for path in fs.find(f"{bucket}/store"):
        assert_absent(fs.cat(path).decode("latin-1"), secret, key_id, where=path)
    # The runs' own files: Prefect's home (results, caches) and the temporary folder (scratch, listings).
    for root, _, names in os.walk(tmp_path):
        for name in names:
            if name != "credentials":
                with open(os.path.join(root, name), "rb") as fh:
                    assert_absent(fh.read().decode("latin-1"), secret, key_id, where=os.path.join(root, name))

    # Prefect's database: once the server has written the runs' events, no table holds the secret.
    database = _prefect_database()
    deadline = time.monotonic() + 60
    while True:
        rows = _database_rows(database)
        runs = [v for t, c, v in rows if t == "flow_run" and c == "parameters" and bucket in v]
        events = [v for t, c, v in rows if t == "events" and "prefect.flow-run.Completed" in v]
        if (len(runs) == 2 and events) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert len(runs) == 2, "two ingest runs, none for the refused commands"
    assert events and any(t == "log" for t, _, _ in rows), "the server has written events and logs"
    for table, column, text in rows:
        assert_absent(text, secret, key_id, where=f"Prefect's database, {table}.{column}")
    for suffix in ("", "-wal"):
        if os.path.exists(database + suffix):
            with open(database + suffix, "rb") as fh:
                assert_absent(fh.read().decode("latin-1"), secret, key_id, where=f"prefect.db{suffix}")


# -- credentials from a named Prefect block ---------------------------------------------------------------------------
@pytest.mark.usefixtures("prefect_harness")
def test_credentials_from_a_named_aws_credentials_block(s3_endpoint, monkeypatch):
    pytest.importorskip("prefect_aws")
    import s3fs
    from prefect_aws import AwsCredentials
    from prefect_aws.client_parameters import AwsClientParameters

    from imgest.storage import Location, credentials

    block_secret = S3_SECRET  # SeaweedFS opens the store only to the keys it knows
    name = f"imgest-test-{os.urandom(3).hex()}"
    AwsCredentials(aws_access_key_id=S3_KEY_ID, aws_secret_access_key=block_secret,
                   region_name="us-east-1",
                   aws_client_parameters=AwsClientParameters(endpoint_url=s3_endpoint)).save(name)
    bucket = f"block-{os.urandom(3).hex()}"
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}).mkdir(bucket)

    assert credentials.storage_options(f"s3://{bucket}/x") == {}, "no block named: botocore's own chain"
    monkeypatch.setenv(credentials.BLOCK_VARIABLE, name)
    assert credentials.storage_options("/local/folder") == {}
    now = [time.monotonic()]  # the store below asks with the real clock too: the test's clock starts from it
    options = credentials.storage_options(f"s3://{bucket}/x", clock=lambda: now[0])
    assert options["secret"] == block_secret and options["endpoint_url"] == s3_endpoint
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")  # the block's keys, not the environment's, open the store
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    loc = Location(f"s3://{bucket}/store", **options)
    loc.write_bytes("a.txt", b"written with the block's credentials")
    assert loc.read_bytes("a.txt").startswith(b"written")
    assert_absent(redact(f"signature {block_secret} rejected"), block_secret, where="a message")

    rotated = "r0tated/Key+" + os.urandom(8).hex()
    AwsCredentials(aws_access_key_id="AKIABLOCK0000000", aws_secret_access_key=rotated,
                   aws_client_parameters=AwsClientParameters(endpoint_url=s3_endpoint)).save(name, overwrite=True)
    assert credentials.storage_options(f"s3://{bucket}/x", clock=lambda: now[0])["secret"] == block_secret
    now[0] += credentials.REFRESH_SECONDS + 1  # loaded again once the cached copy is old
    assert credentials.storage_options(f"s3://{bucket}/x", clock=lambda: now[0])["secret"] == rotated

    for value, expected in ((f"missing-{os.urandom(3).hex()}", "no AwsCredentials block named"),
                            (SECRET, "not a Prefect block name")):
        monkeypatch.setenv(credentials.BLOCK_VARIABLE, value)
        with pytest.raises(StorageError, match=expected) as failed:
            credentials.storage_options(f"s3://{bucket}/x")
        assert "\n" not in str(failed.value)
        assert_absent(str(failed.value), SECRET, where="the error")
