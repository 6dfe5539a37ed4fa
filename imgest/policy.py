"""Retry and timeout policy of the tasks that talk to object stores (Prefect's own retry machinery)."""

from __future__ import annotations

import os

from prefect.tasks import exponential_backoff


def is_final(exc: BaseException | None) -> bool:
    """A fault another try cannot fix: this run lost the writer lock; the store's state says stop; the input is
    malformed; the work does not fit its memory cap. Everything else, timeouts and dropped connections first, is
    worth another try."""
    import duckdb

    from imgest.errors import FinalError
    from imgest.state.lock import LockLostError

    return isinstance(exc, LockLostError | FinalError | MemoryError | duckdb.OutOfMemoryException)


def retry_unless_final(task, task_run, state) -> bool:
    """Prefect retry condition: a task that failed with a final fault (`is_final`) is not retried."""
    return not is_final(getattr(state, "data", None))


def backoff_base() -> float:
    """IMGEST_RETRY_BACKOFF_S (seconds, default 2): the first wait before a retry; each next wait doubles. Longer
    rides out a longer store outage per task; shorter fails a run sooner when the store is really gone."""
    raw = os.environ.get("IMGEST_RETRY_BACKOFF_S", "2")
    try:
        base = float(raw)
    except ValueError:
        raise ValueError(f"IMGEST_RETRY_BACKOFF_S must be a number of seconds, got {raw!r}") from None
    if not base >= 0:
        raise ValueError(f"IMGEST_RETRY_BACKOFF_S must be >= 0, got {raw!r}")
    return base


# Read once, when the tasks are defined (a worker's environment is set before it imports them).
_BASE = backoff_base()
# Object-store and decode I/O: three retries at base, 2x, 4x (2, 4, 8 s by default; +-50% jitter so workers do
# not retry in step).
IO_RETRIES = {"retries": 3, "retry_delay_seconds": exponential_backoff(backoff_factor=_BASE),
              "retry_jitter_factor": 0.5, "retry_condition_fn": retry_unless_final}
# Encode-shard: a retry re-reads and re-encodes the whole shard, so wait five times longer between tries (10, 20 s).
SHARD_RETRIES = {"retries": 2, "retry_delay_seconds": exponential_backoff(backoff_factor=5 * _BASE),
                 "retry_jitter_factor": 0.5, "retry_condition_fn": retry_unless_final}


def io_retrying(what: str, logger):
    """IO_RETRIES for work a task runs in its own threads (the listing's parts): a tenacity Retrying that tries
    three more times after the same waits, with the same jitter, unless the fault is final; each wait logged to
    `logger` (the task's run logger) in one redacted line."""
    import tenacity
    from prefect.utilities.math import clamped_poisson_interval

    from imgest.redact import one_line

    delays = IO_RETRIES["retry_delay_seconds"](IO_RETRIES["retries"])  # Prefect's own waits and jitter, as a task's

    def log(state: tenacity.RetryCallState) -> None:
        logger.warning("%s failed (%s); try %d of %d in %.1f s", what, one_line(state.outcome.exception()),
                       state.attempt_number + 1, 1 + IO_RETRIES["retries"], state.next_action.sleep)

    return tenacity.Retrying(
        stop=tenacity.stop_after_attempt(1 + IO_RETRIES["retries"]),
        wait=lambda state: clamped_poisson_interval(delays[state.attempt_number - 1],
                                                    IO_RETRIES["retry_jitter_factor"]),
        retry=tenacity.retry_if_exception(lambda exc: not is_final(exc)),
        before_sleep=log, reraise=True)


# Upper bounds that only a hung store reaches: listing 100M objects takes hours (infra/SCALING.md).
# Tasks that run in worker threads have none: encode-shard (a thread, or a Dask worker's thread) and
# list-catalogue (its parts in threads of its own), where Prefect cannot interrupt them, and a timeout that cannot stop
# anything would only promise what it does not do (and Prefect warns on every run). A hung connection there
# is ended by botocore's own 60 s connect and read timeouts, then retried by IO_RETRIES.
LIST_TIMEOUT_S = 12 * 3600
COMMIT_TIMEOUT_S = 3600
