"""What a run checks of a store before its work: that the store takes writes where the run will write."""

from __future__ import annotations

import uuid

from imgest.storage.location import Location, StorageError


def check_writable(loc: Location, folder: str) -> None:
    """Create and remove one empty object under `folder`: a store that refuses writes (read-only credentials, a
    read-only mount) is found before the run spends its time, not when it commits. StorageError otherwise."""
    key = f"{folder}/.imgest-write-check-{uuid.uuid4().hex}"
    try:
        loc.create_exclusive(key, b"")
    except (StorageError, OSError) as exc:  # OSError: a file where the folder should be
        raise StorageError(f"store {loc.url} does not take writes under {folder}/: {exc}") from exc
    loc.delete(key)
