"""End to end through `imgest serve` from an installed package (a fresh virtualenv outside the checkout): a real
Prefect server on loopback, the process pool, the package's deployments and a process worker; runs triggered
through the API, read back through the API, then stopped."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import threading
import time
import urllib.request

import pytest

from tests.helpers import WebhookReceiver, gradient, jpeg_bytes, write_files
from tests.s3servers import KEY_ID, SECRET


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`imgest serve` in a subprocess, its output collected line by line."""

    def __init__(self, imgest: str, env: dict, port: int, cwd: str, *args: str):
        self.proc = subprocess.Popen([imgest, "serve", "--port", str(port), *args], env=env, cwd=cwd,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.api = f"http://127.0.0.1:{port}/api"

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip())

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                assert self.proc.poll() is None, "imgest serve exited:\n" + "\n".join(self.output[-30:])
                continue
            self.output.append(line)
            if text in line:
                return line
        raise AssertionError(f"no {text!r} after {timeout} s:\n" + "\n".join(self.output[-30:]))


def _flow_run_page_renders(url: str, run_name: str) -> None:
    """The Prefect UI's flow-run page, in headless Chromium (Debian's, installed by infra/setup.sh), shows
    the run: the single-page app loaded, reached the API and rendered the run's name."""
    import shutil

    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    assert chromium, "Chromium is missing: infra/setup.sh installs Debian's chromium for this check"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(url, wait_until="domcontentloaded")
            page.get_by_text(run_name).first.wait_for(timeout=60_000)
        finally:
            browser.close()


def _artifact_images_load(url: str) -> int:
    """An artifact page in headless Chromium: its markdown rendered, and every image in it loaded (a chart
    that does not load has natural width 0: a broken image, not a screenshot that merely exists)."""
    import shutil

    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url, wait_until="domcontentloaded")
            # one look at the page: the images there, all loaded (or broken), and their widths; the UI renders the
            # markdown more than once, so a locator's images may be gone by a second look
            widths = page.wait_for_function("""() => {
                const images = [...document.querySelectorAll("img[src^='data:image/png']")];
                return images.length > 0 && images.every(i => i.complete) && images.map(i => i.naturalWidth);
            }""", timeout=60_000).json_value()
        finally:
            browser.close()
    assert widths and all(w > 0 for w in widths), f"{url}: chart widths {widths}"
    return len(widths)


def _run(name: str, parameters: dict):
    from prefect.deployments import run_deployment

    return run_deployment(name, parameters=parameters, timeout=400, poll_interval=2)


def test_serve_deploys_runs_nightly_on_a_worker_reports_failure_and_stops(tmp_path, installed_imgest):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    work = tmp_path / "work"  # where serve starts: flow runs start here too, so relative paths resolve here
    write_files(str(work / "catalogue"), {f"p/{i}.jpg": jpeg_bytes(gradient(i, (96, 96))) for i in range(6)})
    port, dead_port = _free_port(), _free_port()  # nothing listens on dead_port: the failing object store
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"),
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{dead_port}", "AWS_ACCESS_KEY_ID": KEY_ID,
           "AWS_SECRET_ACCESS_KEY": SECRET}  # with keys, as a user has them: the endpoint is what fails
    env.pop("PREFECT_API_URL", None)
    env.pop("PYTHONPATH", None)
    receiver = WebhookReceiver()
    served = Served(installed_imgest["imgest"], env, port, str(work), "--notify", receiver.url)
    try:
        alerts = served.wait_for("alerts: ", 240)
        assert "imgest: a run failed" in alerts and "notifying http://127.0.0.1:" in alerts, alerts
        served.wait_for("Prefect UI: http://127.0.0.1:", 60)
        line = served.wait_for("deployments from", 30)
        assert f"{installed_imgest['site']}/imgest/flows/prefect.yaml" in line and f"start in {work}" in line, line
        served.wait_for("started!", 120)  # the worker polls its pool
        with temporary_settings({PREFECT_API_URL: served.api}), get_client(sync_client=True) as client:
            ok = _run("nightly/nightly", {"config": {"catalogue": "catalogue", "store": "store", "batch_size": "2"}})
            assert ok.state.is_completed(), ok.state.message
            assert (work / "store" / "aliases" / "serving.json").exists()
            assert ok.name.startswith("nightly-") and ok.work_pool_name == "imgest-process"
            runs, parents = [ok], [ok.id]
            while parents:  # nightly -> ingest, build-index -> build-version
                children = client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=parents)))
                runs += children
                parents = [c.id for c in children]
            assert "build-version" in {client.read_flow(r.flow_id).name for r in runs}
            artifacts = {a.key: a for a in client.read_artifacts() if a.flow_run_id in {r.id for r in runs}}
            assert {"nightly-summary", "ingest-summary", "ingest-progress", "index-progress", "index-card",
                    "nightly-trend"} <= set(artifacts)
            assert artifacts["ingest-progress"].data == 100.0 and artifacts["index-progress"].data == 100.0
            assert "| 6 | 6 | 0 | 0 | 0 | 0 | 0 | 6 | 0 |" in artifacts["ingest-summary"].data  # listed ... encoded
            assert "v0001" in artifacts["nightly-summary"].data
            _flow_run_page_renders(f"http://127.0.0.1:{port}/runs/flow-run/{ok.id}", ok.name)
            trend = artifacts["nightly-trend"]
            assert "data:image/png;base64," in trend.data
            for ui in ("", "/v2"):  # the default UI and the V2 one: the trend chart loads in both
                assert _artifact_images_load(f"http://127.0.0.1:{port}{ui}/artifacts/artifact/{trend.id}") >= 1

            bad = _run("nightly/nightly", {"config": {"catalogue": "catalogue", "store": "s3://imgest-e2e/store"}})
            assert bad.state.is_failed()
            message = bad.state.message
            assert "\n" not in message and "StorageError: s3://imgest-e2e/store: " in message, message
            assert "failed: EndpointConnectionError" in message and SECRET not in message
            # the alert served with the stack: the failed run's name and a link to it reached the webhook
            post = receiver.wait_for(bad.name)
            assert f"http://127.0.0.1:{port}/runs/flow-run/{bad.id}" in post["body"], post
    finally:
        receiver.server.shutdown()
        if served.proc.poll() is None:
            os.killpg(served.proc.pid, signal.SIGINT)
        try:
            served.wait_for("Prefect server stopped", 120)
        finally:
            served.proc.wait(30)
    assert any(line.startswith("worker stopped") for line in served.output), served.output[-10:]
    assert served.proc.returncode == 0
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{served.api}/health", timeout=2)
