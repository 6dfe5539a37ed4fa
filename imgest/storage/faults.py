"""Failures of a store: the one error they become (`StorageError`, naming the location), the wrapper that makes
them so, and which of them are of the moment (worth another try)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from imgest.errors import UserError
from imgest.storage.records import RecordError


class StorageError(UserError, RuntimeError):
    """An object store could not be reached or used; the message names the URL (redacted)."""


class ContainmentError(StorageError, ValueError):
    """A key or path (usually read from a store record) that would leave the store: refused, never opened."""


def store_io(verb: str) -> Callable:
    """A location's method whose failure of the store itself (unreachable, denied, full) becomes one
    StorageError line naming the location, key and cause (`self.failure`); FileNotFoundError, FileExistsError
    and RecordError stay what they are."""

    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def call(self, key: str = "", *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, key, *args, **kwargs)
            except (FileNotFoundError, FileExistsError, StorageError, RecordError):
                raise
            except Exception as exc:
                raise self.failure(verb, key, exc) from exc

        return call

    return wrap

# Faults of the moment, worth another try later: by exception class anywhere in the cause chain (builtins,
# botocore, aiohttp), or by the throttling and server-error codes S3 answers with.
_TRANSIENT_TYPES = {"TimeoutError", "ConnectionError", "MemoryError", "ReadTimeoutError", "ConnectTimeoutError",
                    "EndpointConnectionError", "ClientConnectionError", "ServerTimeoutError",
                    "ServerDisconnectedError", "IncompleteReadError", "ResponseStreamingError"}
_TRANSIENT_CODES = ("SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestLimitExceeded",
                    "ServiceUnavailable", "InternalError", "503", "500")


def _chain(exc: BaseException | None):
    """`exc` and its causes (or contexts), each once."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _named(exc: BaseException, names: set[str]) -> bool:
    return bool({t.__name__ for t in type(exc).__mro__} & names)


def is_transient(exc: BaseException) -> bool:
    """Whether a failure may go away by itself (timeout, throttling, a dropped connection, memory)."""
    for cause in _chain(exc):
        if _named(cause, _TRANSIENT_TYPES):
            return True
        response = getattr(cause, "response", None)  # botocore's ClientError
        if isinstance(response, dict) and str(response.get("Error", {}).get("Code", "")) in _TRANSIENT_CODES:
            return True
    return False


# The failures that mean the store's server did not answer at all (as against throttling or a 5xx it sent).
_UNANSWERED_TYPES = {"ConnectionError", "EndpointConnectionError", "ClientConnectionError", "ConnectTimeoutError",
                     "ServerDisconnectedError", "ClientConnectorError", "ConnectionRefusedError"}


def unanswered(exc: BaseException) -> bool:
    """Whether the store's server did not answer (refused, unreachable, dropped), anywhere in the cause chain."""
    return any(_named(cause, _UNANSWERED_TYPES) for cause in _chain(exc))


def what_to_do(endpoint: str | None, exc: BaseException) -> str:
    """The advice a failure's line ends with when the store's server did not answer: which endpoint, and that a
    rerun resumes (every commit is all-or-nothing, so nothing half-written is left to clean first)."""
    if not unanswered(exc):
        return ""
    where = endpoint or "the store's endpoint"
    return (f"; {where} did not answer: check that it is up (and that AWS_ENDPOINT_URL names it), then run again: "
            "a rerun resumes where this one stopped")
