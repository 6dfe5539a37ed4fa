"""Catalogue images named by shard rows: read only under the catalogue root the operator gave for the model.

  state/model=<slug>/catalogue.json   {catalogue, recorded}: the root this model was last ingested from

A shard row's `uri` is a record like any other: a planted row must not make imgest fetch a URL or read a file
elsewhere. Each ingest records its catalogue root; a reader (train-head's views and held-out queries,
duplicates' thumbnails) checks the run's catalogue against it when the operator gives one, and reads a row
only when its uri lies under that root, through the catalogue's own Location (which refuses `..`).
"""

from __future__ import annotations

from imgest.errors import UserError
from imgest.state.clock import now_iso
from imgest.state.layout import catalogue_root_key as root_key
from imgest.storage import ContainmentError, Location, RecordError, redact


class CatalogueRootError(UserError, RuntimeError):
    """The run's catalogue is not the one the model was ingested from, or none is known; one line says which."""


def record_root(store: Location, slug: str, catalogue: Location) -> None:
    """Keep the catalogue root this model is ingested from (written when it changes)."""
    root = catalogue.uri()
    if recorded_root(store, slug) != root:
        store.write_json(root_key(slug), {"catalogue": redact(root), "recorded": now_iso()})


def recorded_root(store: Location, slug: str) -> str | None:
    key = root_key(slug)
    if not store.exists(key):
        return None
    record = store.read_json(key)
    root = record.get("catalogue") if isinstance(record, dict) else None
    if not isinstance(root, str) or not root:
        raise RecordError(f"{store.url}: {key}: no catalogue root in it")
    return root


def _same(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


class CatalogueImages:
    """Bytes of the images a model's shard rows name, read only under the operator's catalogue root.

    With ``catalogue`` (the run's, typed by the operator) it must be the root recorded at ingest. Without
    one, the recorded root is used only when it is on the store's own kind of storage (a local store reads a
    local catalogue, an S3 store an S3 one): a record can never make imgest open an http(s) URL."""

    def __init__(self, store: Location, slug: str, catalogue: str | None = None):
        recorded = recorded_root(store, slug)
        if catalogue is not None:
            given = Location(catalogue, follow_links=True)
            if recorded is not None and not _same(given.uri(), recorded):
                raise CatalogueRootError(f"model={slug} was ingested from {recorded}, not {redact(given.uri())}: "
                                         "give the catalogue it was ingested from")
            self.catalogue = given
        elif recorded is None:
            raise CatalogueRootError(f"model={slug} has no recorded catalogue root (ingested before roots were "
                                     "recorded): give --catalogue, or run one ingest to record it")
        else:
            candidate = Location(recorded, follow_links=True)
            if candidate.is_local != store.is_local or candidate.fs.protocol != store.fs.protocol:
                raise CatalogueRootError(f"model={slug}'s recorded catalogue {recorded} is not on the store's kind of "
                                         "storage: give --catalogue to read its images")
            self.catalogue = candidate
        self.root = self.catalogue.uri().rstrip("/") + "/"

    def key(self, uri: object) -> str:
        """The catalogue key of a row's uri, or ContainmentError when it lies outside the root."""
        if not isinstance(uri, str) or not uri.startswith(self.root):
            raise ContainmentError(f"image {redact(str(uri))[:200]!r} is not under the catalogue {redact(self.root)}: "
                                   "not read")
        return self.catalogue.resolve(uri[len(self.root):], "image uri")

    def read(self, uri: object, limit: int | None = None) -> bytes:
        """The image's bytes; with `limit`, an image larger than that is refused (RecordError) after reading at
        most `limit` + 1 bytes."""
        data = self.catalogue.read_bytes(self.key(uri), limit=None if limit is None else limit + 1)
        if limit is not None and len(data) > limit:
            raise RecordError(f"image {redact(str(uri))[:200]!r} is larger than {limit} bytes: not read")
        return data
