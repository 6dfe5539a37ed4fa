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

from imgest import memory  # noqa: E402
from tests.helpers import make_tiny_hf_model  # noqa: E402
from tests.s3servers import DEFAULT as S3_DEFAULT  # noqa: E402
from tests.s3servers import SERVERS as S3_SERVERS  # noqa: E402
from tests.s3servers import MotoServer, SeaweedServer  # noqa: E402
from tests.s3servers import use as use_s3  # noqa: E402

SLOW_FIXTURES = {"prefect_harness", "installed_imgest", "s3_endpoint", "s3_each_endpoint", "moto_server",
                 "seaweedfs_server"}


THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _thread_budget(workers: int) -> int:
    """The cores a test process may keep busy: its share of this machine's, so the workers of `-n N` do not
    fight over the same cores (torch, OpenVINO, faiss and BLAS each default to every core)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, workers))


def pytest_configure(config):
    """The budget, set before torch, numpy or faiss start their thread pools: by the controlling process of
    `-n N`, whose environment its workers start with (a worker's own count of workers comes too late: this file
    was read and its environment copied before), else by the single test process. Subprocesses of a test
    inherit it. A count set in the environment is kept (OMP_NUM_THREADS=2 is every core here, as before the
    budget: docs/development.md). Huge pages likewise, for glibc (`_with_huge_pages`) and for torch, whichever
    a worker imports first (imgest sets torch's when it is imported first: tests/test_memory.py)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    workers = getattr(config.option, "numprocesses", None)
    for name in THREAD_VARIABLES:
        os.environ.setdefault(name, str(_thread_budget(workers if isinstance(workers, int) else 1)))
    os.environ["GLIBC_TUNABLES"] = _with_huge_pages(os.environ.get("GLIBC_TUNABLES", ""))
    os.environ.setdefault(memory.TORCH_HUGE_PAGES, "1")


def _with_huge_pages(tunables: str) -> str:
    """glibc's heap and its large blocks on transparent huge pages (the deployment image sets the same,
    infra/Dockerfile) in the workers and every process a test starts: read when a process starts, so the
    controlling process sets it for those it starts. The suite's processes allocate and free a great deal (torch
    activations, decoded photos, Arrow buffers), each page faulted in by the kernel: a run of
    tests/test_multiscale.py took 13.4 million page faults and 119 s without, 0.9 million and 86 s with this
    and imgest's own setting for torch (imgest/memory.py). A tunable already set is kept."""
    if "glibc.malloc.hugetlb" in tunables:
        return tunables
    return ":".join(filter(None, (tunables, "glibc.malloc.hugetlb=1")))


SLOW_CAUSES = {"prefect_harness": "a Prefect server", "installed_imgest": "a fresh install",
               "s3_endpoint": "an S3 server", "s3_each_endpoint": "each S3 server", "moto_server": "an S3 server",
               "seaweedfs_server": "an S3 server"}


# Files whose tests take a minute or more each (bench/suite_time.py on a run's JUnit report): started first.
LONGEST_FILES = ("test_demo.py", "test_multiscale.py", "test_store_restart.py", "test_operations.py",
                 "test_captions.py", "test_migration.py", "test_duplicate_threshold.py", "test_ingest.py",
                 "test_reliability.py")


def pytest_collection_modifyitems(items):
    """`slow`: a test that starts Prefect, an S3 server or a fresh install, or is marked so by hand (real weights,
    an OpenVINO compile, a subprocess, a sleep: `fast_lane_rule` fails a test that does one unmarked).
    `pytest -m "not slow"` is the fast lane of unit tests.

    The files of minutes-long tests first, then the other slow tests, each file's in its order, then the fast
    lane: xdist hands tests out one at a time in this order (`--maxschedchunk=1` in pyproject.toml; by default
    each worker starts with a quarter of its share, consecutive tests, and one worker was left finishing its
    block of slow tests alone), so the long ones start while there is still other work to pack beside them, and
    the run ends on sub-second tests."""
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)

    def order(item) -> tuple[bool, bool]:
        return item.get_closest_marker("slow") is None, item.path.name not in LONGEST_FILES

    items.sort(key=order)  # stable: files keep their order


IMPORTS_BETWEEN_FREEZES = 200  # modules imported since the last freeze that make a new one worth a collection
_frozen_at = [0]  # len(sys.modules) at the last freeze


def _freeze() -> None:
    import gc

    gc.collect()
    gc.freeze()
    _frozen_at[0] = len(sys.modules)


def pytest_collection_finish(session):
    """What the run keeps alive to its end (the modules imported: torch, transformers, Prefect, scipy, the test
    modules; about a million objects by the end of a worker's share) moved out of the cyclic collector's reach
    (`gc.freeze`): each full collection then walks what the tests made, not every module's objects. Every ingest
    ends with one (imgest.memory.give_back, which gives a long flow's freed memory back), and Python runs its own.
    Frozen here, after collection, and again after a test that imported many more modules (most are imported
    lazily, by the first test that needs them), each time after a collection, so no garbage of the moment is kept.
    A frozen object whose count drops to zero is freed as before."""
    _freeze()


def pytest_runtest_logfinish(nodeid, location):
    if len(sys.modules) - _frozen_at[0] >= IMPORTS_BETWEEN_FREEZES:
        _freeze()


@pytest.fixture(scope="session", autouse=True)
def session_caches(tmp_path_factory) -> pathlib.Path:
    """The compiled-model cache (converted models, parity records, measured batch sizes) of this test run,
    shared by its workers (entries are written whole and renamed into place), never the user's ~/.cache: a
    model is converted, parity-checked and measured once per run, and no run depends on what an earlier one
    left."""
    from imgest.encoders import compiled

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "compiled-cache"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(compiled.CACHE_ENV, str(root))
        yield root


@pytest.fixture(autouse=True)
def slow_causes(request, record_property) -> None:
    """Why the test is in the slow lane (its fixtures, then the reasons its `slow` marks give), as the JUnit
    property `causes`: bench/suite_time.py sums the suite's time by it."""
    causes = [SLOW_CAUSES[name] for name in request.fixturenames if name in SLOW_CAUSES]
    causes += [str(reason) for mark in request.node.iter_markers("slow") for reason in mark.args]
    if request.node.get_closest_marker("slow") and not causes:
        causes.append("marked slow")
    record_property("causes", ", ".join(dict.fromkeys(causes)))


class FastLaneViolation(Exception):
    """What a test not marked slow did that the fast lane has no room for."""


FAST_LANE = ("the fast lane (tests not marked slow) has no server, no real weights, no OpenVINO compile, no "
             "subprocess and no sleep")


@pytest.fixture(autouse=True)
def fast_lane_rule(request, monkeypatch):
    """A test not marked slow that starts a subprocess or a server, loads packaged weights, compiles an OpenVINO
    model or sleeps fails, naming what it did: mark it `@pytest.mark.slow`, or make it cheaper."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    import multiprocessing.process
    import socket
    import threading

    from imgest import encoders
    from imgest.encoders import efficientnet, openvino_runtime, text

    seen: list[str] = []

    def refuse(what: str):
        def refused(*args, **kwargs):
            seen.append(what)
            raise FastLaneViolation(f"{request.node.nodeid}: {what}; {FAST_LANE}")
        return refused

    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        if seconds > 0:
            caller = sys._getframe(1)
            what = f"time.sleep({seconds}) in {caller.f_code.co_filename}:{caller.f_lineno}"
            seen.append(what)
            if threading.current_thread() is threading.main_thread():
                raise FastLaneViolation(f"{request.node.nodeid}: {what}; {FAST_LANE}")
        real_sleep(seconds)

    real_execute = subprocess.Popen._execute_child

    def execute_child(self, *args, **kwargs):
        # ctypes.util.find_library asks ldconfig where a shared library is (PyTurboJPEG's, once per process): a
        # library being located, not a test starting a process of its own
        if sys._getframe(2).f_code.co_filename.endswith(os.path.join("ctypes", "util.py")):
            return real_execute(self, *args, **kwargs)
        return refuse("starts a subprocess")()

    monkeypatch.setattr(subprocess.Popen, "_execute_child", execute_child)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse("starts a process"))
    monkeypatch.setattr(socket.socket, "listen", refuse("starts a server (listens on a socket)"))
    monkeypatch.setattr(openvino_runtime.OpenVINORuntime, "compile", refuse("compiles an OpenVINO model"))
    packaged, real_load = {*efficientnet.NAMES, text.NAME}, encoders.load

    def load(spec, *args, **kwargs):  # loaded in this process before or not: the fast lane may run it first
        base = spec
        while base.base is not None:  # a head runs on its base model's weights
            base = base.base
        if base.family in packaged:
            return refuse(f"loads the packaged weights of {base.name}")()
        return real_load(spec, *args, **kwargs)
    monkeypatch.setattr(encoders, "load", load)
    monkeypatch.setattr(time, "sleep", sleep)
    yield
    if seen:
        pytest.fail(f"{request.node.nodeid}: {'; '.join(dict.fromkeys(seen))}: {FAST_LANE}; mark it "
                    "@pytest.mark.slow or make it cheaper", pytrace=False)


@pytest.fixture(scope="session")
def prefect_harness():
    """A Prefect server for the process's flow runs. Flow-run heartbeats (crash detection for runs a worker
    started) are off: each run and subflow would otherwise wait up to a second at its end for the heartbeat
    thread's sleep, and no test here is about Prefect's crash detection."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90), \
            temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
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


@pytest.fixture(params=[S3_DEFAULT])
def s3_endpoint(request) -> str:
    """A real S3 API server on 127.0.0.1 (SeaweedFS), its endpoint and keys in the environment (AWS_ENDPOINT_URL,
    AWS_ACCESS_KEY_ID, ...) for this test only, as a user sets theirs. For what works the same on any S3 API."""
    return use_s3(request, request.param)


@pytest.fixture(params=S3_SERVERS)
def s3_each_endpoint(request) -> str:
    """As `s3_endpoint`, once on each server (moto's, then SeaweedFS): for the behaviours in which S3 servers
    differ (conditional writes, listing, errors, faults), where one server's answer proves nothing of another's."""
    return use_s3(request, request.param)


def _shared_folder(tmp_path_factory, name: str, make) -> pathlib.Path:
    """A folder of this test run made once by `make(folder)` and shared by its workers (one makes it under a lock,
    renames it into place; the others wait and read it): the same path, so the same model ids, and what the host
    keeps for a model (its compiled graphs, parity and decode-side records) is measured once per run."""
    import fcntl

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    with open(f"{root}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not root.exists():
            building = root.with_name(f".{name}-{os.getpid()}")
            building.mkdir()
            make(building)
            building.rename(root)
    return root


@pytest.fixture(scope="session")
def tiny_model_folders(tmp_path_factory) -> dict[str, str]:
    """Tiny random CLIP, SigLIP and DINOv2 saved as local transformers folders: the hf: path, offline. Not
    listed in IMGEST_MODEL_DIRS: a store may not name them until a test lists them (`tiny_models`). One set for
    the run, shared by its workers."""
    kinds = ("clip", "siglip", "dinov2")
    root = _shared_folder(tmp_path_factory, "hf-models",
                          lambda folder: [make_tiny_hf_model(kind, str(folder / kind)) for kind in kinds])
    return {kind: str(root / kind) for kind in kinds}


@pytest.fixture
def tiny_models(tiny_model_folders, monkeypatch) -> dict[str, str]:
    """The tiny models' folders, listed for this test in IMGEST_MODEL_DIRS as an operator lists theirs (store
    records may then name them: imgest.encoders.recorded)."""
    root = os.path.dirname(next(iter(tiny_model_folders.values())))
    monkeypatch.setenv("IMGEST_MODEL_DIRS", root)
    return tiny_model_folders


@pytest.fixture(scope="session")
def tiny_siglip_sentencepiece_folder(tmp_path_factory) -> str:
    """A tiny random SigLIP whose tokenizer is a SentencePiece model trained here, offline: SiglipTokenizer, as the
    real checkpoints ship (imgest[hf]). Not listed in IMGEST_MODEL_DIRS until a test lists it
    (`tiny_siglip_sentencepiece`)."""
    root = _shared_folder(tmp_path_factory, "hf-sentencepiece", lambda folder: make_tiny_hf_model(
        "siglip", str(folder / "siglip"), tokenizer="sentencepiece"))
    return str(root / "siglip")


@pytest.fixture
def tiny_siglip_sentencepiece(tiny_siglip_sentencepiece_folder, monkeypatch) -> str:
    """That SigLIP's folder, listed for this test in IMGEST_MODEL_DIRS (as `tiny_models` lists theirs)."""
    monkeypatch.setenv("IMGEST_MODEL_DIRS", os.path.dirname(tiny_siglip_sentencepiece_folder))
    return tiny_siglip_sentencepiece_folder


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


@pytest.fixture(scope="session")
def lite0():
    """The packaged EfficientNet-Lite0 in eager torch fp32 on the CPU (the parity reference): loaded once per test
    process, for tests of what the model computes rather than of the runtime that computes it."""
    from imgest import encoders

    return encoders.load(encoders.resolve("efficientnet-lite0"), "cpu", "torch", "fp32")


@pytest.fixture
def host_measured_nothing(tmp_path, monkeypatch) -> pathlib.Path:
    """A host that has measured no batch size yet (its compiled models kept): a run measures, as on a new host."""
    from imgest.tasks.ingest import batch_size

    folder = tmp_path / "host-tuning"
    monkeypatch.setattr(batch_size, "host_folder", lambda: str(folder))
    return folder


@pytest.fixture
def compiled_cache(tmp_path, monkeypatch) -> pathlib.Path:
    """A compiled-model cache of the test's own (and no encoder loaded before it), so conversions and parity
    records are seen happening; it starts with what the run made of the parity sample, as a host's cache does:
    the photos and torch fp32's embeddings of them (each written whole, then only read: linked, not copied)."""
    from imgest import encoders
    from imgest.encoders import compiled

    folder = tmp_path / "compiled"
    for made in ("parity-sample", "references"):  # the photos made once (~20 s), a model's reference once (~15 s)
        if (pathlib.Path(compiled.root()) / made).is_dir():
            shutil.copytree(pathlib.Path(compiled.root()) / made, folder / made, copy_function=os.link,
                            ignore=shutil.ignore_patterns("*.npy.*"))  # not another's half-written file
    monkeypatch.setenv(compiled.CACHE_ENV, str(folder))
    monkeypatch.setattr(encoders, "_loaded", {})
    return folder
