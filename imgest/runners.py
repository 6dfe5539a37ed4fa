"""Where shard encoding runs: threads in the flow's process, or a Dask cluster through prefect-dask.

Dask rather than Ray: a shard task is a plain Python call on NumPy/PyTorch data with no actors or
object store to share, which is what Dask's scheduler does with the least machinery; prefect-dask
is kept by Prefect; `distributed.LocalCluster` gives real worker processes on one machine, and the
same flow reaches a remote cluster (dask-kubernetes, dask-jobqueue, Coiled) by its scheduler address.
"""

from __future__ import annotations

import os

from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

SHARDS_AHEAD = 4  # shards submitted ahead of the one the flow waits on, per worker: keeps every worker busy


def shard_runner(runner: str, workers: int = 0) -> TaskRunner:
    """The task runner for encode-shard tasks.

    local: one shard at a time in this process (each shard already decodes in parallel ahead of its
    encoder; two shards sharing one model would only fight over the same cores or GPU).
    dask: a LocalCluster of worker processes, one thread each (Dask sets OMP_NUM_THREADS=1 in its
    workers, so N workers use N cores), each loading the model once.
    tcp://...: an existing Dask cluster; its workers need imgest installed and the store reachable.
    """
    if runner == "local":  # runner and workers were validated with the flow's configuration
        return ThreadPoolTaskRunner(max_workers=1)
    from prefect_dask import DaskTaskRunner

    if runner == "dask":
        # The workers report their task runs to this flow's API, also when that is Prefect's ephemeral
        # server (they would otherwise each start a temporary one of their own).
        return DaskTaskRunner(cluster_class="distributed.LocalCluster",
                              cluster_kwargs={"n_workers": workers or os.cpu_count() or 1, "threads_per_worker": 1,
                                              "processes": True, "dashboard_address": None,
                                              "env": {"PREFECT_API_URL": _api_url()}})
    return DaskTaskRunner(address=runner)


def _api_url() -> str:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return str(client.api_url).rstrip("/")


def submit_in_order(runner: TaskRunner, task, items, parameters: dict, ahead: int):
    """(item, future) for each of `items` in order, `task` run on `runner` with `parameters` and the item as
    `plan`, at most `ahead` submitted before the oldest is handed back: a cold start's shards are planned on
    disk, and only the shards in flight are held as objects (a map of them all would hold every one)."""
    from collections import deque

    from prefect.utilities.annotations import quote

    # Quoted on the local runner: Prefect walks a task's parameters looking for futures, 0.13 s for a shard of
    # 2,000 objects (5 ms quoted, measured), which was most of a derived shard's cost (20 of a 10M cold start's
    # 38 minutes). prefect-dask hands a quoted value to its worker as a bare tuple, so there it goes as it is
    # (a worker's shard takes seconds; the walk is the flow's, ahead of the workers).
    wrap = quote if isinstance(runner, ThreadPoolTaskRunner) else (lambda item: item)
    flight: deque = deque()
    for item in items:
        flight.append((item, runner.submit(task, {**parameters, "plan": wrap(item)})))
        if len(flight) >= ahead:
            yield flight.popleft()
    while flight:
        yield flight.popleft()
