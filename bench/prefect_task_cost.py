"""What Prefect's server spends per task run, as the test suite's harness runs it: a flow of 100 trivial tasks,
with and without a tag on them (imgest tags an ingest's and a build's tasks `model:<slug>`), on
`prefect_test_harness`'s server; the server's CPU seconds (psutil, its process) per flow.

    .venv/bin/python bench/prefect_task_cost.py
    PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED=false PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED=false \\
        .venv/bin/python bench/prefect_task_cost.py
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

import psutil  # noqa: E402
from prefect import flow, tags, task  # noqa: E402
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings  # noqa: E402
from prefect.testing.utilities import prefect_test_harness  # noqa: E402

TASKS = 100


@task
def one(i: int) -> int:
    return i


@flow
def many(tagged: bool, n: int) -> list[int]:
    if tagged:
        with tags("model:bench-0000"):
            return [one(i) for i in range(n)]
    return [one(i) for i in range(n)]


def server_cpu() -> float:
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            if "uvicorn" in " ".join(child.cmdline()):
                times = child.cpu_times()
                total += times.user + times.system
        except psutil.Error:
            pass
    return total


def main() -> None:
    with prefect_test_harness(server_startup_timeout=90), \
            temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        many(False, 5)
        for tagged in (False, True, False, True):
            time.sleep(3)
            server, started = server_cpu(), time.perf_counter()
            many(tagged, TASKS)
            wall = time.perf_counter() - started
            time.sleep(3)  # the server records task runs from their events, after the flow returns
            print(f"tagged={tagged}: {TASKS} tasks in {wall:.2f} s; server CPU {server_cpu() - server:.2f} s",
                  flush=True)


if __name__ == "__main__":
    main()
