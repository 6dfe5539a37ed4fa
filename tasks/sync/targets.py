"""Sync targets: the URL forms, the protocol every vector database meets, and the registry of them.

  milvus://HOST:PORT/COLLECTION          a Milvus server           (pymilvus MilvusClient)
  milvus:///path/db.db/COLLECTION        a Milvus Lite file        (the same client, milvus-lite)
  qdrant://HOST:PORT/COLLECTION          a Qdrant server           (qdrant-client)
  qdrant:///path/folder/COLLECTION       Qdrant's local mode in a folder
  lancedb://PATH_OR_URL/TABLE            LanceDB, embedded: a folder (lancedb:///data/lance/TABLE) or an object
                                         store (lancedb://s3://bucket/prefix/TABLE)

COLLECTION (or TABLE) always answers for the store's `serving` alias, and a model's vectors never share a physical
collection with another model's. Milvus and Qdrant: each model syncs into its own collection,
`COLLECTION__<model slug>`, and COLLECTION is a collection alias moved in one call to the serving model's. LanceDB has
no aliases: TABLE holds the serving model's rows, another model syncs into `TABLE__<model slug>`, and a switch
swaps the two tables' contents (TABLE replaced in one commit, so a reader sees one model or the other).

A URL never carries credentials (they would land in logs, run parameters and the store's watermarks): a user
part or a query is refused in one line. MILVUS_TOKEN and QDRANT_API_KEY come from the environment, or from the
Prefect Secret block that IMGEST_MILVUS_TOKEN_BLOCK or IMGEST_QDRANT_API_KEY_BLOCK names (only the block's name
travels); the object store's from its usual variables (AWS_ACCESS_KEY_ID, ...) or its AwsCredentials block.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import pyarrow as pa

from imgest.errors import UserError
from imgest.redact import one_line, redact_url, register_secret, url_secrets


class SyncError(UserError, ValueError):
    """A target that cannot be synced as asked (bad URL, another model's collection); one line saying why."""


class TargetError(RuntimeError):
    """A target that failed while it was synced (down, busy, refusing a batch): one line naming the target, and
    `reason`: the step and what the engine said. Nothing of that sync is recorded in the store; the next one
    catches up."""

    def __init__(self, url: str, reason: str):
        super().__init__(f"sync to {redact_url(url)} failed: {reason}")
        self.reason = reason


_BLOCK_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,127}")  # Prefect's block names; anything else is never echoed


def credential(variable: str) -> str | None:
    """A target's credential: the environment variable `variable` if set, else the value of the Prefect Secret
    block named by IMGEST_<variable>_BLOCK (``name`` or ``secret/name``), masked in every message once loaded."""
    value = os.environ.get(variable, "")
    if value:
        return value
    named = f"IMGEST_{variable}_BLOCK"
    name = os.environ.get(named, "").strip().removeprefix("secret/")
    if not name:
        return None
    if not _BLOCK_NAME.fullmatch(name):
        raise SyncError(f"{named}: not a Prefect block name (lowercase letters, digits and '-'); it names a Secret "
                        "block, it never holds the credential")
    from prefect.blocks.system import Secret

    try:
        value = str(Secret.load(name).get())
    except Exception as exc:  # noqa: BLE001 - any failure to load is one line; its text never holds the secret
        raise SyncError(f"{named}: the Secret block {name!r} could not be loaded ({type(exc).__name__})") from None
    register_secret(value)
    return value or None


@dataclass(frozen=True)
class TargetSpec:
    """A parsed target URL: which engine, where, which collection or table."""

    url: str
    engine: str
    where: str  # milvus/qdrant: host:port, or a local path (a file for Milvus Lite, a folder for Qdrant/LanceDB)
    name: str  # the collection or table
    local: bool

    @property
    def slug(self) -> str:
        """The target's name in the store (sync/<slug>/): readable, and unique by a hash of the whole URL."""
        readable = re.sub(r"[^a-z0-9._-]+", "-", f"{self.engine}-{self.where}-{self.name}".lower()).strip("-.")
        return f"{readable[-60:].lstrip('-.')}-{hashlib.sha256(self.url.encode()).hexdigest()[:10]}"


MAX_SAID = 500  # an engine's message may quote a whole filter of a thousand ids: its start says enough


def target_failed(spec: TargetSpec, step: str, exc: BaseException) -> TargetError:
    """`exc`, raised by a target's client during `step`, as one line: masked, cut to MAX_SAID characters."""
    return TargetError(spec.url, f"{step}: {one_line(exc, MAX_SAID)}")


@dataclass(frozen=True)
class Model:
    """What a collection is made for: vectors of one model, of one dimension, compared by inner product."""

    model_id: str
    slug: str
    dim: int


class Target(Protocol):
    """A target's name and the collections behind it, one per model. Upserts and deletes are idempotent (keyed
    by item_id): a sync killed at any moment and run again converges to the same collection. An item_id is a
    catalogue key, untrusted: any UTF-8 up to 1,024 bytes (quotes, backslashes, filter syntax); it reaches the
    engine as a value (a point id, a row) or as a literal escaped by the engine's own grammar, never as syntax."""

    collection: str  # the physical collection or table open() opened (writes, reads and counts go there)

    def open(self, model: Model, columns: pa.Schema, takes_name: bool = False) -> bool:
        """Open `model`'s own collection: create it (True), or check an existing one was made for it (False);
        a collection of another model raises SyncError. `columns`: the metadata columns rows will carry;
        `takes_name`: point() follows (LanceDB then creates a missing TABLE itself rather than a copy)."""

    def answers(self) -> str | None:
        """The model id the target's name answers for now; None while it names nothing."""

    def point(self, model: Model) -> None:
        """Make the name answer for `model`'s collection (synced, and opened with open(), first)."""

    def open_named(self) -> str | None:
        """Open what the name answers for, to read it (search, get, count); its model id, None if nothing."""

    def drop(self, model: Model) -> bool:
        """Drop `model`'s own collection (never the one the name answers for); False: there was none."""

    def upsert(self, batches: Iterable[pa.Table]) -> None:
        """Write every batch's rows (item_id, vector, metadata columns, each item_id once), replacing those with
        the same item_id, in as many calls and commits as the engine needs (batches are read as they are
        written: never all at once)."""

    def delete(self, item_ids: list[str]) -> None:
        """Remove these items; ids the collection does not hold are ignored."""

    def search(self, vector: Iterable[float], k: int) -> list[tuple[str, float]]:
        """(item_id, inner product) of the k nearest, best first (for checks and tests)."""

    def get(self, item_ids: list[str]) -> dict[str, dict]:
        """The stored rows of these ids (metadata included, vector left out), for checks and tests."""

    def count(self) -> int:
        """Rows the collection holds."""

    def close(self) -> None:
        ...


MODEL_KEY = "imgest.model_id"  # where each engine keeps the model id: properties, collection metadata, schema
SLUG_KEY = "imgest.model_slug"  # beside it: the model's slug (LanceDB's swap names the table a model moves to)
MAX_NAME = 255  # Milvus's limit on a collection or alias name, the strictest of the three


def physical_name(spec: TargetSpec, model: Model) -> str:
    """The collection (or non-serving table) a model syncs into: `<name>__<slug>`, the slug's '-' and '.' as
    '_' (the three engines' names are letters, digits and '_')."""
    name = f"{spec.name}__{re.sub(r'[^A-Za-z0-9_]', '_', model.slug)}"
    if len(name) > MAX_NAME:
        raise SyncError(f"--to {spec.url}: the collection for model={model.slug} would be named {name[:40]}... "
                        f"({len(name)} characters, at most {MAX_NAME}); use a shorter collection name")
    return name


def plain_collection(spec: TargetSpec) -> SyncError:
    """A collection under the target's own name, where imgest keeps an alias (made by an imgest that synced
    into it directly, or by something else)."""
    return SyncError(f"--to {spec.url}: {spec.name} is a collection, not the alias imgest keeps there (each model "
                     f"syncs into {spec.name}__<model> and {spec.name} names the serving one); drop {spec.name}, "
                     "or sync to another name, and the next sync rebuilds it")


@dataclass(frozen=True)
class Engine:
    """A registered engine: where its Target class lives (imported only when a target of it is opened, so the
    other engines' clients need not be installed) and its URL forms."""

    module: str
    cls: str
    forms: str


TARGETS = {
    "milvus": Engine("imgest.tasks.sync.milvus", "MilvusTarget",
                     "milvus://HOST:PORT/COLLECTION or milvus:///path/db.db/COLLECTION (Milvus Lite)"),
    "qdrant": Engine("imgest.tasks.sync.qdrant", "QdrantTarget",
                     "qdrant://HOST:PORT/COLLECTION or qdrant:///path/folder/COLLECTION (local mode)"),
    "lancedb": Engine("imgest.tasks.sync.lance", "LanceTarget",
                      "lancedb:///path/folder/TABLE or lancedb://s3://bucket/prefix/TABLE"),
}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,254}$")  # Milvus's rule, the strictest of the three


def _forms() -> str:
    return "; ".join(f"{name}: {engine.forms}" for name, engine in TARGETS.items())


def parse_target(url: str) -> TargetSpec:
    """The target a URL names, or SyncError in one line (credentials, unknown engine, missing collection)."""
    url = str(url).strip()
    engine, sep, rest = url.partition("://")
    if not sep or engine not in TARGETS:
        raise SyncError(f"--to {redact_url(url)!r}: unknown target; the forms are {_forms()}")
    found = url_secrets(url)
    nested = rest.partition("://")[2] if engine == "lancedb" else rest
    if found or "@" in nested.split("/", 1)[0] or "@" in rest.split("/", 1)[0]:
        raise SyncError(f"--to {redact_url(url)} is refused: it carries {', '.join(found) or 'credentials'}; give "
                        "the plain URL, and credentials through MILVUS_TOKEN, QDRANT_API_KEY or the object store's "
                        "environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE)")
    if "?" in url or "#" in url:
        raise SyncError(f"--to {redact_url(url)}: a target URL takes no query or fragment (credentials come from "
                        "the environment: MILVUS_TOKEN, QDRANT_API_KEY, AWS_*)")
    where, _, name = rest.rstrip("/").rpartition("/")
    if not where or not _NAME.match(name):
        raise SyncError(f"--to {url!r}: name the {'table' if engine == 'lancedb' else 'collection'} last (letters, "
                        f"digits and '_', starting with a letter or '_'); the forms are {TARGETS[engine].forms}")
    local = where.startswith("/") or (engine == "lancedb" and "://" not in where)
    if engine == "lancedb" and where.startswith("file://"):
        where, local = where[len("file://"):], True
    if not local and engine != "lancedb" and not re.match(r"^[A-Za-z0-9.\-\[\]:]+:\d+$", where):
        raise SyncError(f"--to {url!r}: expected HOST:PORT or an absolute path before the collection; the forms are "
                        f"{TARGETS[engine].forms}")
    return TargetSpec(url=url, engine=engine, where=where, name=name, local=local)


def open_target(spec: TargetSpec) -> Target:
    """The client for a target (the engine's package imported here, so other engines need not be installed)."""
    import importlib

    engine = TARGETS[spec.engine]
    try:
        factory = getattr(importlib.import_module(engine.module), engine.cls)
        return factory(spec)
    except ImportError as exc:
        raise SyncError(f"--to {spec.engine}: its client is not installed ({exc.name}); install imgest[sync]") \
            from None


def check_model(spec: TargetSpec, name: str, found: str | None, model: Model, rows: int) -> None:
    """Refuse a collection `name` made by another model (or by something else than imgest, when it holds
    rows): a model change never mixes two models' vectors in one collection."""
    if found == model.model_id:
        return
    what = "collection" if spec.engine != "lancedb" else "table"
    if found is None and rows == 0:
        return  # created by a sync killed before it recorded the model: adopted
    made = f"by model {found}" if found else "outside imgest (no model id recorded)"
    raise SyncError(f"--to {spec.url}: the {what} {name} was made {made}, not {model.model_id}; sync another "
                    f"{what}, or drop that one first")


def plain(value: object) -> object:
    """A metadata value as JSON (Milvus dynamic fields and Qdrant payloads): dates and decimals as text."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return str(value)
