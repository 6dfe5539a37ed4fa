"""Index versions: immutable folders with a card written last, opened only when their checksums match.

  indexes/model=<slug>/v<NNNN>/index.faiss   the faiss file
  indexes/model=<slug>/v<NNNN>/ids.parquet   faiss id -> item_id, uri, content_hash
  indexes/model=<slug>/v<NNNN>/truth.parquet exact neighbours of the recall probes (carried by updates)
  indexes/model=<slug>/v<NNNN>/card.json     what made it, what it serves; its presence means complete
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from imgest.errors import UserError
from imgest.retrieval.idmap import IdMap, IdMapFile
from imgest.retrieval.mapped import open_mapped
from imgest.state.aliases import list_aliases, read_alias
from imgest.state.clock import now_iso
from imgest.state.layout import index_prefix, version_prefix
from imgest.state.lock import Fence
from imgest.storage import Location, records
from imgest.storage.cache import local_copy

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "imgest", "indexes")


class IndexIntegrityError(UserError, RuntimeError):
    """An index file does not match the checksum its card records; it is never served."""


class IndexNotFoundError(UserError, LookupError):
    """No such alias, model index or version; the message lists what exists."""


# A version's files have fixed names in its folder: a card that names another place is refused, never followed.
FILES = {"index_file": "index.faiss", "ids_file": "ids.parquet", "truth_file": "truth.parquet"}


def _version_numbers(store: Location, slug: str) -> list[int]:
    return sorted(int(n[1:]) for n in store.list_names(index_prefix(slug)) if re.fullmatch(r"v\d{4,}", n))


def list_versions(store: Location, slug: str) -> list[int]:
    """Complete versions only: a folder without its card is a build that did not finish."""
    return [v for v in _version_numbers(store, slug) if store.exists(f"{version_prefix(slug, v)}/card.json")]


def write_version(store: Location, slug: str, index_file: str, ids: pa.Table | IdMapFile, card: dict,
                  fence: Fence | None = None, truth: pa.Table | None = None) -> dict:
    """Write index (from a local file, streamed), id map and exact lists, then the card with their checksums;
    returns the card. Never overwrites."""
    version = max(_version_numbers(store, slug), default=0) + 1
    prefix = version_prefix(slug, version)
    store.put_file(f"{prefix}/index.faiss", index_file)
    if isinstance(ids, IdMapFile):
        store.put_file(f"{prefix}/ids.parquet", ids.path)
        ids_sha256 = _file_sha256(ids.path)
    else:
        ids_sha256 = hashlib.sha256(store.write_table(f"{prefix}/ids.parquet", ids)).hexdigest()
    card = {
        **card,
        "version": version,
        "index_file": f"{prefix}/index.faiss",
        "ids_file": f"{prefix}/ids.parquet",
        "sha256": _file_sha256(index_file),
        "ids_sha256": ids_sha256,
        "bytes_on_disk": os.path.getsize(index_file),
        "created": now_iso(),
    }
    if truth is not None:
        truth_bytes = store.write_table(f"{prefix}/truth.parquet", truth)
        card.update(truth_file=f"{prefix}/truth.parquet", truth_sha256=hashlib.sha256(truth_bytes).hexdigest())
    if card.get("lineage") and card["lineage"]["trained_in"] is None:  # trained here: its number is known now
        card["lineage"] = {**card["lineage"], "trained_in": version}
    if fence is not None:
        fence.check(store)  # the card makes the version complete: not from a build that lost the lock
    if not store.create_exclusive(f"{prefix}/card.json", json.dumps(card, indent=2, sort_keys=True).encode()):
        raise RuntimeError(f"index version {prefix} already has a card; versions are immutable")
    return card


def version_exists(store: Location, card: dict) -> bool:
    """The version a card describes is still complete in the store, with the same index file."""
    key = f"{version_prefix(card['slug'], card['version'])}/card.json"
    return store.exists(key) and store.read_json(key).get("sha256") == card.get("sha256")


def version_file(card: dict, name: str) -> str:
    """The key of a version's file (``index_file``, ``ids_file``, ``truth_file``): its fixed place in the
    version's folder. A card naming any other place was not written by imgest: refused."""
    key = f"{version_prefix(card['slug'], card['version'])}/{FILES[name]}"
    if card.get(name) != key:
        raise IndexIntegrityError(f"card of model={card['slug']} v{card['version']:04d}: {name} "
                                  f"{str(card.get(name))[:120]!r} is not the version's own {FILES[name]}: refused")
    return key


def read_card(store: Location, slug: str, version: int) -> dict:
    """A version's card, checked to describe that version: its slug, version and checksums well-formed and
    its files in its own folder (a planted card cannot point a search at another file)."""
    key = f"{version_prefix(slug, version)}/card.json"
    if not store.exists(key):
        have = ", ".join(f"v{v:04d}" for v in list_versions(store, slug)) or "none"
        raise IndexNotFoundError(f"no index version {version} for model={slug}; complete versions: {have}")
    card = store.read_json(key)
    where = f"{store.url}: {key}"
    if records.field(card, "slug", str, where) != slug or records.version(card.get("version"), where) != version:
        raise IndexIntegrityError(f"{where} describes model={str(card.get('slug'))[:80]} "
                                  f"v{str(card.get('version'))[:12]}, not the version it is stored as: refused")
    for name, checksum in (("index_file", "sha256"), ("ids_file", "ids_sha256"), ("truth_file", "truth_sha256")):
        if name != "truth_file" or card.get(name) is not None:
            version_file(card, name)
            records.sha256(card.get(checksum), f"{where}: {checksum}")
    return card


def _verified_bytes(store: Location, key: str, sha256: str) -> bytes:
    data = store.read_bytes(key)
    if hashlib.sha256(data).hexdigest() != sha256:
        raise IndexIntegrityError(f"{key} does not match the checksum in its card: refusing to use it")
    return data


def ids_file(store: Location, card: dict, cache_dir: str = DEFAULT_CACHE) -> str:
    """The version's id map on local disk (the store's file itself when it is local), its checksum checked
    against the card's before a reader opens it: for readers that scan it (DuckDB) instead of loading it."""
    path = local_copy(store, version_file(card, "ids_file"), cache_dir, card["ids_sha256"], ".parquet")
    if _file_sha256(path) != card["ids_sha256"]:
        raise IndexIntegrityError(f"{version_file(card, 'ids_file')} does not match the checksum in its card: "
                                  "refusing to use it")
    return path


def read_truth(store: Location, card: dict) -> pa.Table | None:
    """The exact neighbour lists stored with a version (None for versions built before they were kept)."""
    if not card.get("truth_file"):
        return None
    return pq.read_table(pa.BufferReader(_verified_bytes(store, version_file(card, "truth_file"),
                                                         card["truth_sha256"])))


def memory_budget() -> int:
    """What reading one index may allocate: IMGEST_INDEX_MEMORY (e.g. 24G), else half the machine's memory.
    The operator's figure, never the card's: a card is as forgeable as the file it describes."""
    from imgest.names import parse_memory

    if value := os.environ.get("IMGEST_INDEX_MEMORY"):
        return parse_memory(value)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def verified_file(store: Location, card: dict, cache_dir: str, io_flags: int = 0) -> str:
    """The version's index file on local disk, checked before faiss reads a byte of it: the sizes its header
    claims fit the file, agree with the card's d and n and fit the memory budget (under the flags it will be
    read with); then its checksum matches the card's."""
    from imgest.retrieval.header import IndexHeaderError, check_index_file

    key = version_file(card, "index_file")
    path = local_copy(store, key, cache_dir, card["sha256"], ".faiss")
    try:
        claims = {"dim": records.field(card, "d", int, key), "ntotal": records.field(card, "n", int, key)}
        check_index_file(path, memory_budget=memory_budget(), io_flags=io_flags, expect=claims)
    except (IndexHeaderError, records.RecordError) as exc:
        raise IndexIntegrityError(f"{key}: refused before reading it: {exc} (limit: IMGEST_INDEX_MEMORY)") from exc
    actual = _file_sha256(path)
    if actual != card["sha256"]:
        raise IndexIntegrityError(f"{key} has sha256 {actual[:16]}..., its card says {card['sha256'][:16]}...: "
                                  "refusing to serve a corrupted index")
    return path


def _refine_of_card(card: dict) -> str | None:
    """Where a version's re-rank vectors live, as its card records it ("disk", "ram" or None)."""
    footprint = card.get("footprint") if isinstance(card.get("footprint"), dict) else {}
    return footprint.get("refine")


def read_index_for_update(store: Location, card: dict, cache_dir: str = DEFAULT_CACHE):
    """The version's index read into memory (its lists writable), checked first (`verified_file`); re-rank
    vectors kept on disk stay mapped (the update writes them anew, a block at a time)."""
    import faiss

    if _refine_of_card(card) == "disk":
        return open_mapped(verified_file(store, card, cache_dir, faiss.IO_FLAG_MMAP_IFC))
    return faiss.read_index(verified_file(store, card, cache_dir))


# -- opening ---------------------------------------------------------------------------------------
@dataclass
class OpenIndex:
    card: dict
    index: object  # faiss.Index with the served search parameter set
    ids: IdMap  # faiss id -> item_id, uri (memory-mapped)

    @property
    def item_ids(self) -> pa.ChunkedArray:
        return self.ids.item_ids

    def search(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.index.search(np.ascontiguousarray(vectors, np.float32), k)


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def resolve_target(store: Location, alias: str | None, slug: str | None, version: int | None) -> tuple[str, int]:
    if slug is None:
        entry = read_alias(store, alias or "serving")
        if entry is None:
            have = ", ".join(sorted(list_aliases(store))) or "none"
            raise IndexNotFoundError(f"no alias {alias or 'serving'!r} in {store.url}; aliases: {have}")
        return entry["slug"], entry["version"]
    if version is None:
        versions = list_versions(store, slug)
        if not versions:
            raise IndexNotFoundError(f"model={slug} has no complete index in {store.url}; run build-index")
        version = versions[-1]
    return slug, int(version)


def served_flags(kind: str, refine: str | None) -> int:
    import faiss

    if refine == "disk":
        return faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY
    return faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY if kind in ("ivfsq8", "ivfpq") else 0


def read_served(path: str, kind: str, refine: str | None):
    """An index file read for serving: a re-ranking index with its vectors on disk keeps them memory-mapped and
    copies its PQ part to RAM; IVF indexes are memory-mapped; others are read whole."""
    import faiss

    if refine == "disk":
        return open_mapped(path, served_flags(kind, refine))
    return faiss.read_index(path, served_flags(kind, refine))


def version_counts(store: Location, card: dict, cache_dir: str = DEFAULT_CACHE) -> tuple[int, int]:
    """(vectors in the index, rows of the id map) of a written version, both files checked as `open_index`
    checks them, the index read as it is served (IVF memory-mapped) and the id map's rows counted from its
    footer: what a build verifies before an alias moves, without the N ids in memory."""
    kind, refine = records.field(card, "kind", str, card["slug"]), _refine_of_card(card)
    index = read_served(verified_file(store, card, cache_dir, served_flags(kind, refine)), kind, refine)
    return index.ntotal, pq.read_metadata(ids_file(store, card, cache_dir)).num_rows


def open_index(store: Location, slug: str, version: int, cache_dir: str = DEFAULT_CACHE) -> OpenIndex:
    """Verify the checksum, then read (IVF indexes memory-mapped) and set the served parameter."""

    from imgest.retrieval.params import set_param

    card = read_card(store, slug, version)
    kind, refine = records.field(card, "kind", str, slug), _refine_of_card(card)
    index = read_served(verified_file(store, card, cache_dir, served_flags(kind, refine)), kind, refine)
    set_param(index, card["search"]["param"], card["search"]["value"], card["search"].get("k_factor"))
    ids = IdMap(ids_file(store, card, cache_dir), card["ids_sha256"], cache_dir)
    if len(ids) != index.ntotal:
        raise IndexIntegrityError(f"{version_file(card, 'ids_file')} maps {len(ids)} ids for the index's "
                                  f"{index.ntotal} vectors: refused")
    return OpenIndex(card, index, ids)


def previous_version(store: Location, slug: str) -> dict | None:
    """The version an update starts from: the newest one an alias serves for this model (after a rollback to
    an older version, that one), else the newest complete version."""
    versions = set(list_versions(store, slug))
    served = [int(a["version"]) for a in list_aliases(store).values()
              if a.get("slug") == slug and int(a["version"]) in versions]
    chosen = max(served) if served else max(versions, default=None)
    return read_card(store, slug, chosen) if chosen is not None else None


def served_parameters(card: dict) -> str:
    search = card["search"]
    refine = f", k_factor={search['k_factor']}" if search.get("k_factor") is not None else ""
    return f"{search['param']}={search['value']}{refine}" if search["param"] else "exact search"
