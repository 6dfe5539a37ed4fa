"""Faults of the moment: which failures of a store may go away by themselves (and deserve another try)."""

from __future__ import annotations

# Faults of the moment, worth another try later: by exception class anywhere in the cause chain (builtins,
# botocore, aiohttp), or by the throttling and server-error codes S3 answers with.
_TRANSIENT_TYPES = {"TimeoutError", "ConnectionError", "MemoryError", "ReadTimeoutError", "ConnectTimeoutError",
                    "EndpointConnectionError", "ClientConnectionError", "ServerTimeoutError",
                    "ServerDisconnectedError", "IncompleteReadError", "ResponseStreamingError"}
_TRANSIENT_CODES = ("SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestLimitExceeded",
                    "ServiceUnavailable", "InternalError", "503", "500")


def is_transient(exc: BaseException) -> bool:
    """Whether a failure may go away by itself (timeout, throttling, a dropped connection, memory)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if {t.__name__ for t in type(exc).__mro__} & _TRANSIENT_TYPES:
            return True
        response = getattr(exc, "response", None)  # botocore's ClientError
        if isinstance(response, dict) and str(response.get("Error", {}).get("Code", "")) in _TRANSIENT_CODES:
            return True
        exc = exc.__cause__ or exc.__context__
    return False
