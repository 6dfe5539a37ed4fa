"""`imgest serve`: a local Prefect stack (server, process work pool, the package's deployments, a worker),
started in that order and stopped in reverse on Ctrl-C or SIGTERM. It serves Prefect, not search.

The deployments are the package's own `imgest/flows/prefect.yaml` (module-path entrypoints), so this
works from an installed package as from a checkout; flow runs start in the directory serve was started
from, where relative catalogue and store paths resolve.

The worker and the server run in their own process groups, so one Ctrl-C in the terminal reaches this
process only and it stops them in order: the process worker needs two signals to stop (the first asks
it to finish polling, the second ends it), then the server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from importlib import resources
from pathlib import Path

POOL = "imgest-process"  # the work pool prefect.yaml's deployments name


class ServeError(RuntimeError):
    """The server, the pool, the deployments or the worker could not be started; says which and why."""


def _prefect() -> list[str]:
    # the interpreter running imgest, not a `prefect` script on PATH: the same environment wherever it is
    return [sys.executable, "-m", "prefect"]


def deployments_file() -> Path:
    """The package's prefect.yaml (a real file in a wheel or an editable checkout)."""
    return Path(str(resources.files("imgest.flows").joinpath("prefect.yaml")))


def _default_signals() -> None:
    """In a child before exec: SIGINT and SIGTERM do what they do by default (Python: KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def wait_healthy(api_url: str, timeout: float, alive: Callable[[], bool]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise ServeError("the Prefect server exited while starting; run `prefect server start` to see why")
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise ServeError(f"the Prefect server at {api_url} was not healthy after {timeout:.0f} s")


def stop(proc: subprocess.Popen, name: str, signals: int = 2, grace: float = 15.0,
         say: Callable[[str], None] = print) -> None:
    """SIGINT up to `signals` times, `grace` seconds each, then SIGKILL: nothing is left behind."""
    for _ in range(signals):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):  # it may end between poll() and here
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            continue
    if proc.poll() is None:
        say(f"{name} did not stop after {signals} signal(s); killing it")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    say(f"{name} stopped (exit {proc.returncode})")


def serve(host: str = "127.0.0.1", port: int = 4200, pool: str = POOL, startup_timeout: float = 120.0,
          say: Callable[[str], None] = print, notify: str | None = None,
          nightly_within_hours: float | None = None) -> None:
    """Server, pool, deployments, alerts and a worker, until Ctrl-C or SIGTERM; `notify`: the webhook the
    alerts post to (none: they exist and tell nobody, and this says so)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from imgest.redact import redact_url
    from imgest.tasks.watch.alerts import DEFAULT_NIGHTLY_WITHIN_HOURS, apply_alerts, notification_block

    if notify:
        notification_block(notify)  # a URL that cannot make one fails before anything starts
    spec = deployments_file()
    if not spec.is_file():
        raise ServeError(f"{spec} is missing from the installed package: reinstall imgest")
    workdir = os.getcwd()  # flow runs start here (prefect.yaml's pull step reads $PWD when deploying)
    api_url = f"http://{host}:{port}/api"
    env = {**os.environ, "PREFECT_API_URL": api_url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PWD": workdir}
    procs: list[tuple[str, subprocess.Popen]] = []

    def start(name: str, *args: str) -> subprocess.Popen:
        proc = subprocess.Popen([*_prefect(), *args], cwd=workdir, env=env, start_new_session=True,
                                preexec_fn=_default_signals)
        procs.append((name, proc))
        return proc

    def run(*args: str) -> None:
        out = subprocess.run([*_prefect(), *args], cwd=workdir, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            tail = (out.stderr.strip() or out.stdout.strip()).splitlines()[-1:] or ["no output"]
            raise ServeError(f"`prefect {' '.join(args)}` failed: {tail[0]}")

    def on_term(signum, frame):  # SIGTERM (docker stop, systemd) stops like Ctrl-C
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    # A shell starts background jobs with SIGINT ignored, and Python then never turns Ctrl-C into
    # KeyboardInterrupt: take SIGINT back, here and (preexec) in the children.
    interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        server = start("Prefect server", "server", "start", "--host", host, "--port", str(port))
        wait_healthy(api_url, startup_timeout, lambda: server.poll() is None)
        run("work-pool", "create", pool, "--type", "process", "--overwrite")
        run("--no-prompt", "deploy", "--all", "--prefect-file", str(spec))
        with temporary_settings({PREFECT_API_URL: api_url}):
            applied = apply_alerts(notify, nightly_within_hours or DEFAULT_NIGHTLY_WITHIN_HOURS)
        say(f"alerts: {'; '.join(a['name'] for a in applied)}; " + (
            f"notifying {redact_url(notify)}" if notify else
            "nobody will be told: pass --notify URL (a Slack, Teams or any JSON webhook)"))
        worker = start("worker", "worker", "start", "--pool", pool)
        say(f"Prefect UI: http://{host}:{port}  (API {api_url})")
        say(f"worker on pool {pool!r}; deployments from {spec}; flow runs start in {workdir}; Ctrl-C stops "
            "everything")
        say(f"run one now: PREFECT_API_URL={api_url} prefect deployment run nightly/nightly")
        while worker.poll() is None and server.poll() is None:
            time.sleep(0.5)
        gone = "worker" if worker.poll() is not None else "Prefect server"
        raise ServeError(f"the {gone} exited unexpectedly; stopping the rest")
    except KeyboardInterrupt:
        say("stopping")
    finally:
        # a second Ctrl-C or SIGTERM must not cut the shutdown short and orphan the server
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for name, proc in reversed(procs):
            stop(proc, name, signals=2 if name == "worker" else 1, say=say)
        signal.signal(signal.SIGINT, interrupt)
        signal.signal(signal.SIGTERM, previous)
