"""Shared fixtures: a real Prefect server (one per session), real S3 servers on loopback (moto, SeaweedFS), tiny
models."""

from __future__ import annotations

import os

# Before Prefect or botocore are imported: offline, no analytics, nothing probes off the machine.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
# No AWS configuration of the machine's reaches a test: the S3 fixtures set endpoint and keys per test, as a user
# sets theirs, and a test that reaches S3 without them meets what a user without keys meets.
for _name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE",
              "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
    os.environ.pop(_name, None)
os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.environ["AWS_CONFIG_FILE"] = os.devnull
# Prefect's retries wait 0.05 s instead of 2-20 s: the tests of a store fault see every retry, not the wait.
os.environ.setdefault("IMGEST_RETRY_BACKOFF_S", "0.05")

import pathlib  # noqa: E402
import shutil  # noqa: E402
import site  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

from tests.helpers import make_tiny_hf_model  # noqa: E402
from tests.s3servers import SERVERS as S3_SERVERS  # noqa: E402
from tests.s3servers import MotoServer, SeaweedServer  # noqa: E402
from tests.s3servers import use as use_s3  # noqa: E402

SLOW_FIXTURES = {"prefect_harness", "installed_imgest", "s3_endpoint", "moto_server", "seaweedfs_server"}


def pytest_collection_modifyitems(items):
    """`slow`: a test that starts Prefect, an S3 server or a fresh install (or is marked so by hand, for real
    weights and subprocesses). `pytest -m "not slow"` is the fast lane of unit tests."""
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield


@pytest.fixture(scope="session")
def moto_server():
    """moto's S3 server, once per test process (its keys unchecked)."""
    server = MotoServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def seaweedfs_server(tmp_path_factory):
    """SeaweedFS 4.48, once per test process, its data and log under the session's temporary folder."""
    server = SeaweedServer(tmp_path_factory.mktemp("seaweedfs")).start()
    yield server
    server.stop()


@pytest.fixture(params=S3_SERVERS)
def s3_endpoint(request) -> str:
    """A real S3 API server on 127.0.0.1, moto's then SeaweedFS's: the test runs once on each. Its endpoint and
    keys are in the environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...) for this test only; both servers
    live for the session, so a test's environment names only its own."""
    return use_s3(request, request.param)


@pytest.fixture(scope="session")
def tiny_model_folders(tmp_path_factory) -> dict[str, str]:
    """Tiny random CLIP, SigLIP and DINOv2 saved as local transformers folders: the hf: path, offline. Not
    listed in IMGEST_MODEL_DIRS: a store may not name them until a test lists them (`tiny_models`)."""
    root = tmp_path_factory.mktemp("hf-models")
    return {kind: make_tiny_hf_model(kind, str(root / kind)) for kind in ("clip", "siglip", "dinov2")}


@pytest.fixture
def tiny_models(tiny_model_folders, monkeypatch) -> dict[str, str]:
    """The tiny models' folders, listed for this test in IMGEST_MODEL_DIRS as an operator lists theirs (store
    records may then name them: imgest.encoders.recorded)."""
    root = os.path.dirname(next(iter(tiny_model_folders.values())))
    monkeypatch.setenv("IMGEST_MODEL_DIRS", root)
    return tiny_model_folders


@pytest.fixture(scope="session")
def installed_imgest(tmp_path_factory) -> dict[str, str]:
    """imgest pip-installed (a wheel, not editable) into a fresh virtualenv outside the checkout, as a user
    installs it. Its third-party dependencies come from this test environment's site-packages through a
    .pth line (installing torch a second time would only cost minutes); imgest itself does not."""
    root = pathlib.Path(__file__).resolve().parent.parent
    work = tmp_path_factory.mktemp("installed")
    source = work / "source"  # the committed layout only: no build/ or egg-info of earlier builds
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, source / name)
    for name in ("imgest", "flows", "tasks"):
        shutil.copytree(root / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = work / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(source)], check=True, capture_output=True, timeout=300)
    wheel = next(wheels.glob("imgest-*.whl"))
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    venv_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip()
    (pathlib.Path(venv_site) / "imgest-test-dependencies.pth").write_text(
        "\n".join(p for p in site.getsitepackages() if "site-packages" in p) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--ignore-installed", str(wheel)], check=True, capture_output=True, timeout=300)
    return {"python": str(python), "imgest": str(venv / "bin" / "imgest"), "site": venv_site, "wheel": str(wheel)}


class Clock:
    """The time code under test reads (passed as `clock=`): moved by the test, never slept through. It starts at
    the real time, so what it stamps reads like any other record."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def compiled_cache(tmp_path, monkeypatch) -> pathlib.Path:
    """A compiled-model cache of the test's own (and no encoder loaded before it), so conversions and parity
    records are seen happening."""
    from imgest import encoders
    from imgest.encoders import compiled

    folder = tmp_path / "compiled"
    monkeypatch.setenv(compiled.CACHE_ENV, str(folder))
    monkeypatch.setattr(encoders, "_loaded", {})
    return folder
