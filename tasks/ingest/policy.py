"""Retry and timeout policy of the tasks that talk to object stores (Prefect's own retry machinery)."""

from __future__ import annotations

from prefect.tasks import exponential_backoff


def retry_unless_final(task, task_run, state) -> bool:
    """Prefect retry condition: a fault another try cannot fix is not retried (this run lost the writer
    lock; the store's state says stop). Everything else, timeouts and dropped connections first, is."""
    from imgest.lock import LockLostError

    return not isinstance(getattr(state, "data", None), LockLostError)


# Object-store and decode I/O: three retries at about 2, 4, 8 s (+-50% jitter so workers do not retry in step).
IO_RETRIES = {"retries": 3, "retry_delay_seconds": exponential_backoff(backoff_factor=2), "retry_jitter_factor": 0.5,
              "retry_condition_fn": retry_unless_final}
# Encode-shard: a retry re-reads and re-encodes the whole shard, so wait longer between tries.
SHARD_RETRIES = {"retries": 2, "retry_delay_seconds": exponential_backoff(backoff_factor=10),
                 "retry_jitter_factor": 0.5, "retry_condition_fn": retry_unless_final}
# Upper bounds that only a hung store reaches: listing 100M objects takes hours (infra/SCALING.md).
# Tasks that run in worker threads have none: encode-shard (a thread, or a Dask worker's thread) and the
# fanned-out list-catalogue parts, where Prefect cannot interrupt them, and a timeout that cannot stop
# anything would only promise what it does not do (and Prefect warns on every run). A hung connection there
# is ended by botocore's own 60 s connect and read timeouts, then retried by IO_RETRIES.
LIST_TIMEOUT_S = 12 * 3600
COMMIT_TIMEOUT_S = 3600
