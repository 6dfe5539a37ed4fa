"""Local copies of a store's objects (index files, snapshots), named by hashing: never a record's text."""

from __future__ import annotations

import hashlib
import os
import re
import uuid

from imgest.storage.location import Location


def local_copy(loc: Location, key: str, cache_dir: str, checksum: str, suffix: str = "") -> str:
    """A local file path for ``key``: the file itself on a disk, else a download cached under a name hashed
    from the location, the key and the checksum the caller expects (never a record's text as a file name)."""
    if loc.is_local:
        return loc.path(key)
    os.makedirs(cache_dir, exist_ok=True)
    digest = hashlib.sha256(f"{loc.uri(key)}\n{checksum}".encode()).hexdigest()
    target = os.path.join(cache_dir, digest + (suffix if _SUFFIX.match(suffix) else ""))
    if not os.path.exists(target):
        tmp = f"{target}.{uuid.uuid4().hex}.part"
        loc.fs.get_file(loc.path(key), tmp)
        os.replace(tmp, target)
    return target


_SUFFIX = re.compile(r"^(\.[a-z0-9]{1,8})?$")
