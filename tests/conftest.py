"""Shared fixtures: a real Prefect server (one per session), a real S3 endpoint on loopback, tiny models."""

from __future__ import annotations

import os

# Before Prefect or botocore are imported: offline, no analytics, nothing probes off the machine.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
os.environ["AWS_ACCESS_KEY_ID"] = "imgest-test-key-id"
os.environ["AWS_SECRET_ACCESS_KEY"] = "imgest-test-secret-never-logged"
os.environ["AWS_DEFAULT_REGION"] = "us-east-1"

import pytest  # noqa: E402

from tests.helpers import make_tiny_hf_model  # noqa: E402


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 API server on 127.0.0.1 (moto's), reached by s3fs through AWS_ENDPOINT_URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    previous = os.environ.get("AWS_ENDPOINT_URL")
    os.environ["AWS_ENDPOINT_URL"] = url
    yield url
    server.stop()
    if previous is None:
        os.environ.pop("AWS_ENDPOINT_URL", None)
    else:
        os.environ["AWS_ENDPOINT_URL"] = previous


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Tiny random CLIP, SigLIP and DINOv2 saved as local transformers folders: the hf: path, offline."""
    root = tmp_path_factory.mktemp("hf-models")
    return {kind: make_tiny_hf_model(kind, str(root / kind)) for kind in ("clip", "siglip", "dinov2")}
