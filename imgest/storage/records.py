"""Store records read back: JSON parsed within limits, and the grammar of the names records carry, checked
before any becomes a path or a model.

Anyone who can write one object into the store can plant a record; a record too large, too deep or with a
field that fails its grammar is malformed (RecordError, one line naming the record and the field), never a
path, a URL or a traceback.
"""

from __future__ import annotations

import json
import re
from typing import Any

from imgest.errors import UserError
from imgest.redact import one_line

MAX_RECORD_BYTES = 16 << 20  # a JSON record larger than this is not one imgest wrote
MAX_RECORD_DEPTH = 32


class RecordError(UserError, ValueError):
    """A store record that is not one imgest wrote: too large, too deep, not JSON, or a field out of grammar."""


def depth(value: Any, limit: int) -> int:
    """Nesting of a parsed JSON value (a scalar is 0, ``[]`` is 1), without recursion; counting stops past
    ``limit`` (a value nested 100,000 deep costs no more than one nested limit + 1)."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, dict | list):
            level += 1
            deepest = max(deepest, level)
            if deepest > limit:
                break
            todo.extend((v, level) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_record(data: bytes, where: str, *, max_bytes: int = MAX_RECORD_BYTES,
                 max_depth: int = MAX_RECORD_DEPTH) -> Any:
    """A JSON record parsed within limits: size before parsing, nesting after (never a RecursionError)."""
    if len(data) > max_bytes:
        raise RecordError(f"{where}: {len(data):,} bytes, over the {max_bytes:,}-byte limit of a JSON record")
    try:
        obj = json.loads(data)
    except RecursionError as exc:
        raise RecordError(f"{where}: nested deeper than {max_depth} levels (the limit of a JSON record)") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecordError(f"{where}: not a JSON record ({one_line(exc)[:160]})") from exc
    if depth(obj, max_depth) > max_depth:
        raise RecordError(f"{where}: nested deeper than {max_depth} levels (the limit of a JSON record)")
    return obj



# What EncoderSpec.slug makes: a readable name and a digest, folder-safe, no dots at either end.
SLUG = re.compile(r"^[a-z0-9](?:[a-z0-9._-]{0,126}[a-z0-9])?$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
MAX_VERSION = 10**9


def field(record: Any, name: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``record[name]`` when the record is an object and the value has the expected type."""
    if not isinstance(record, dict):
        raise RecordError(f"{where}: expected a JSON object, got {type(record).__name__}")
    value = record.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        want = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise RecordError(f"{where}: field {name!r} must be {want}, got {type(value).__name__} {str(value)[:60]!r}")
    return value


def slug(value: Any, where: str) -> str:
    """A model slug from a record (``efficientnet-lite0-1a2b3c4d``): lowercase letters, digits, '.', '-', '_'."""
    if not isinstance(value, str) or not SLUG.match(value) or ".." in value:
        raise RecordError(f"{where}: {str(value)[:80]!r} is not a model slug (lowercase letters, digits, '.', '-', "
                          "'_'; no '..')")
    return value


def version(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < MAX_VERSION:
        raise RecordError(f"{where}: {str(value)[:40]!r} is not an index version (an integer from 1)")
    return value


def sha256(value: Any, where: str) -> str:
    if not isinstance(value, str) or not SHA256.match(value):
        raise RecordError(f"{where}: {str(value)[:80]!r} is not a sha256 checksum (64 hex digits)")
    return value


def target(record: Any, where: str) -> dict:
    """An alias-like record's target: its slug, version and checksum checked; the record itself returned."""
    slug(field(record, "slug", str, where), f"{where}: slug")
    version(record.get("version"), f"{where}: version")
    sha256(record.get("sha256"), f"{where}: sha256")
    return record
