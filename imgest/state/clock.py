"""The clock store records are stamped with: UTC, ISO 8601 to the second."""

from __future__ import annotations

from datetime import UTC, datetime


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
