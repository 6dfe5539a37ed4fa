"""Object-store credentials: a named Prefect AwsCredentials block when one is configured, else botocore's chain.

Only the block's NAME travels (an environment variable, never a flow parameter); its secrets are loaded by the
process that opens the store, kept in memory and masked in every message (imgest.redact).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from imgest.redact import one_line, register_secret
from imgest.storage.faults import StorageError

BLOCK_VARIABLE = "IMGEST_AWS_CREDENTIALS_BLOCK"
BLOCK_TYPE = "aws-credentials"  # prefect-aws's AwsCredentials
REFRESH_SECONDS = 600.0  # a block's assumed-role credentials last an hour; a rotated key is picked up within this
_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,127}")  # Prefect's block names; anything else is never echoed
_S3 = ("s3://", "s3a://")

_cache: dict[str, tuple[float, dict[str, Any]]] = {}
_lock = threading.Lock()


def block_name() -> str | None:
    """The AwsCredentials block named by IMGEST_AWS_CREDENTIALS_BLOCK (``name`` or ``aws-credentials/name``)."""
    name = os.environ.get(BLOCK_VARIABLE, "").strip()
    return name.removeprefix(f"{BLOCK_TYPE}/") or None


def storage_options(url: str, *, clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """fsspec storage options with the credentials for ``url``: those of the configured Prefect AwsCredentials
    block for an s3:// URL, else ``{}`` (botocore's default chain: AWS_* variables, AWS_PROFILE and the shared
    files, then the role of the container or instance)."""
    name = block_name()
    if name is None or not str(url).strip().lower().startswith(_S3):
        return {}
    with _lock:
        cached = _cache.get(name)
        if cached is None or clock() - cached[0] > REFRESH_SECONDS:
            cached = _cache[name] = (clock(), _from_block(name))
    return {**cached[1], "client_kwargs": dict(cached[1].get("client_kwargs", {}))}


def _fail(message: str) -> Exception:

    return StorageError(f"{BLOCK_VARIABLE}: {message}")


def _from_block(name: str) -> dict[str, Any]:
    if not _NAME.fullmatch(name):
        raise _fail("not a Prefect block name (lowercase letters, digits and '-'); it names an AwsCredentials "
                    "block, it never holds a key")
    try:
        from prefect_aws import AwsCredentials
    except ImportError:
        raise _fail(f"the block {name!r} needs prefect-aws (pip install prefect-aws); or unset it to use "
                    "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or a role") from None
    try:
        block = AwsCredentials.load(name, _sync=True)
    except ValueError as exc:  # Prefect: "Unable to find block document named ..."
        raise _fail(f"no AwsCredentials block named {name!r} on the Prefect server: create it in the UI (Blocks) "
                    f"or with AwsCredentials(...).save({name!r}) ({one_line(exc)})") from None
    except Exception as exc:  # the Prefect API unreachable, a block of another type: one line
        raise _fail(f"the AwsCredentials block {name!r} could not be loaded: {one_line(exc)}") from None
    return _options(block)


def _options(block: Any) -> dict[str, Any]:
    """s3fs's options from an AwsCredentials block; each secret is registered for masking before it is used."""
    secret = block.aws_secret_access_key.get_secret_value() if block.aws_secret_access_key else None
    key, token, profile = block.aws_access_key_id, block.aws_session_token, block.profile_name
    if block.assume_role_arn:  # prefect-aws assumes the role with the block's base credentials
        try:
            frozen = block.get_boto3_session().get_credentials().get_frozen_credentials()
        except Exception as exc:
            raise _fail(f"assuming {block.assume_role_arn} failed: {one_line(exc)}") from None
        key, secret, token, profile = frozen.access_key, frozen.secret_key, frozen.token, None
    for value in (key, secret, token):
        register_secret(value)
    options: dict[str, Any] = {name: value for name, value in
                               (("key", key), ("secret", secret), ("token", token), ("profile", profile)) if value}
    client = block.aws_client_parameters
    if client.endpoint_url:
        options["endpoint_url"] = client.endpoint_url
    if not client.use_ssl:
        options["use_ssl"] = False
    client_kwargs = {"region_name": block.region_name} if block.region_name else {}
    if client.verify_cert_path:
        client_kwargs["verify"] = str(client.verify_cert_path)
    elif client.verify is not None:
        client_kwargs["verify"] = client.verify
    if client_kwargs:
        options["client_kwargs"] = client_kwargs
    return options


def check_no_credentials(url: str, what: str = "URL", *, signed_ok: bool = False) -> None:
    """Credentials never travel in a URL (they would land in run parameters, logs and artifacts): neither in
    its user part, whatever the secret holds (``s3://KEY:ab/c+d@bucket``), nor as a presigned or SAS query
    (``signed_ok``: accepted where the URL is read and never stored, e.g. a query image of a query set)."""
    from imgest.redact import redact_url, url_secrets

    found = url_secrets(url, query=not signed_ok)
    if found:
        raise StorageError(f"{what} {redact_url(url)} is refused: it carries {', '.join(found)}, which Prefect "
                           "would store with the run's parameters; give the plain URL, and credentials through "
                           "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or a role, or a Prefect "
                           "AwsCredentials block named in IMGEST_AWS_CREDENTIALS_BLOCK")
