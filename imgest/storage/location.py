"""A location in object storage (a folder, file://, s3://...): keys made paths inside its root, reads, atomic
writes, exclusive create, listing; the one place that calls fsspec."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from imgest.redact import USERINFO, one_line, redact  # noqa: F401  (callers import them from here)
from imgest.storage.conditional import TEMP_PREFIX, ConditionalWrites
from imgest.storage.credentials import check_no_credentials  # noqa: F401  (callers import it from here)
from imgest.storage.credentials import storage_options as credential_options
from imgest.storage.faults import ContainmentError, StorageError, is_transient, store_io, what_to_do  # noqa: F401
from imgest.storage.records import MAX_RECORD_BYTES, RecordError, parse_record  # noqa: F401  (callers import them here)

MAX_KEY_CHARS = 1024
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _contained(key: str, field: str = "key") -> str:
    """``key`` with its outer slashes removed, refused when a segment would climb out (``..``) or is odd."""
    key = str(key).strip("/")
    if "\x00" in key or any(part in (".", "..") for part in key.split("/")):
        raise ContainmentError(f"{field}: {key[:200]!r} climbs out of its location ('..' or '.'): refused")
    return key


STREAM_BUFFER = 1 << 20  # a streamed Parquet read's buffer: a column's pages come in reads of this size


def parquet_reader(source, **options) -> pq.ParquetFile:
    """A Parquet file read in parts (row groups, batches) with memory that follows the part. Arrow's default
    (`pre_buffer`) fetches every column chunk a read will need at once, which for a whole-file `iter_batches` is
    the whole file: numbering a 10M-item build's id map held 213-358 MB of it (measured 2026-12-06); streamed, 34."""
    return pq.ParquetFile(source, pre_buffer=False, buffer_size=STREAM_BUFFER, **options)


@dataclass(frozen=True)
class ObjectInfo:
    key: str  # path relative to the root, '/'-separated
    size: int
    mtime: float | None
    etag: str | None
    regular: bool = True  # a regular file (after following a symlink); FIFOs, devices and sockets are not
    storage_class: str | None = None  # object stores: GLACIER and DEEP_ARCHIVE cannot be read until restored


def _normalise(url: str) -> str:
    url = str(url).strip()
    if not url:
        raise StorageError("empty storage URL; give a local folder, file://, s3://bucket/prefix or any fsspec URL")
    check_no_credentials(url)
    if "://" not in url and not url.startswith("/"):
        url = os.path.abspath(url)
    return url.rstrip("/") or "/"


def _mtime(info: dict[str, Any]) -> float | None:
    value = info.get("mtime", info.get("LastModified", info.get("last_modified")))
    if value is None:
        return None
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    return float(value)


def _etag(info: dict[str, Any]) -> str | None:
    value = info.get("ETag", info.get("etag"))
    return str(value).strip('"') if value else None


def _url_to_fs(url: str, **storage_options: Any):
    """fsspec's url_to_fs, with the S3 endpoint made explicit so fsspec's instance cache is keyed on it
    (botocore also reads AWS_ENDPOINT_URL, but a cached filesystem would keep an old endpoint)."""
    storage_options = {**credential_options(url), **storage_options}  # a named Prefect block, when set
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if url.startswith(("s3://", "s3a://")) and endpoint and "endpoint_url" not in storage_options:
        storage_options["endpoint_url"] = endpoint
    try:
        return fsspec.core.url_to_fs(url, **storage_options)
    except (ImportError, ValueError) as exc:
        raise StorageError(f"cannot open {redact(url)}: {exc}") from exc




class Location(ConditionalWrites):
    """A root URL on some filesystem; keys below it are '/'-separated relative paths."""

    def __init__(self, url: str, *, follow_links: bool = False, **storage_options: Any):
        self.url = _normalise(url)
        self.fs, self.root = _url_to_fs(self.url, **storage_options)
        self.root = self.root.rstrip("/") or "/"
        self.is_local = "file" in _protocols(self.fs)
        # A store never follows a link out of its root; a local catalogue's links are the operator's (only a
        # shell on the host makes them), followed like the files they name.
        self.follow_links = follow_links
        self._real_root = os.path.realpath(self.root) if self.is_local else None

    def __repr__(self) -> str:
        return f"Location({redact(self.url)!r})"

    @property
    def endpoint(self) -> str | None:
        """The S3 endpoint this location's client talks to (None: local, or the provider's default)."""
        client = getattr(self.fs, "client_kwargs", None) or {}
        return redact(getattr(self.fs, "endpoint_url", None) or client.get("endpoint_url") or "") or None

    def failure(self, verb: str, key: str, exc: BaseException) -> StorageError:
        return StorageError(redact(f"{self.url}: {verb} {key.strip('/') or '/'} failed: ") + one_line(exc)
                            + what_to_do(self.endpoint, exc))

    # -- paths -------------------------------------------------------------------------------
    def path(self, key: str = "") -> str:
        """The filesystem path of ``key``: the one place a key becomes a path, so the one place containment is
        enforced. No ``..`` or ``.`` segment, no NUL; on a local store, no link that resolves outside the root."""
        key = _contained(key)
        if not key:
            return self.root
        path = f"{self.root}/{key}" if self.root != "/" else f"/{key}"
        if self._real_root is not None and not self.follow_links:
            real = os.path.realpath(path)
            if real != self._real_root and not real.startswith(self._real_root.rstrip("/") + "/"):
                raise ContainmentError(f"{redact(self.url)}: {key!r} resolves to {real!r}, outside the store (a "
                                       "link out of it): refused")
        return path

    def resolve(self, value: Any, field: str) -> str:
        """A key named by a record (a card's file, a retirement's slug, a head's folder), validated against the
        key grammar and checked inside this location; anything else is refused with a line naming the field.

        Accepts a relative key (``indexes/model=x/v0001/index.faiss``) or this location's own full URL of one
        (``s3://bucket/store/heads/h``, ``/abs/store/heads/h``); never ``..``, another scheme, bucket or root."""
        if not isinstance(value, str) or not value or len(value) > MAX_KEY_CHARS:
            raise ContainmentError(f"{field}: expected a key inside {redact(self.url)}, got "
                                   f"{type(value).__name__} {str(value)[:80]!r}")
        text = value.strip()
        for root in {self.uri(), self.url, self.root}:
            if text == root or text.startswith(root.rstrip("/") + "/"):
                text = text[len(root.rstrip("/")):].lstrip("/")
                break
        else:
            if "://" in text or text.startswith(("/", "\\")) or _SCHEME.match(text):
                raise ContainmentError(f"{field}: {redact(value)[:200]!r} is not inside {redact(self.url)}: refused")
        if not text or "\\" in text or any(ord(c) < 32 for c in text):
            raise ContainmentError(f"{field}: {redact(value)[:200]!r} is not a key of the store: refused")
        _contained(text, field)
        self.path(text)  # links out of a local store
        return text

    def uri(self, key: str = "") -> str:
        """Full URL of a key, as users see it (``s3://bucket/prefix/key`` or an absolute path)."""
        path = self.path(key)
        return path if self.is_local else self.fs.unstrip_protocol(path)

    # -- listing -----------------------------------------------------------------------------
    @store_io("checking")
    def exists(self, key: str = "") -> bool:
        return self.fs.exists(self.path(key))

    @store_io("checking")
    def reachable(self) -> bool:
        """Whether the root answers now, asked over the wire (never from fsspec's listing cache): how a
        store-wide fault is told apart from one object's."""
        self.fs.invalidate_cache(self.root)
        return self.fs.exists(self.root)

    @store_io("checking")
    def modified(self, key: str) -> float | None:
        """When ``key`` was last written (epoch seconds), or None when it does not exist."""
        try:
            return _mtime(self.fs.info(self.path(key)))
        except FileNotFoundError:
            return None

    def walk(self, key: str = "", maxdepth: int | None = None) -> Iterator[ObjectInfo]:
        """Every object below ``key`` (recursively, or `maxdepth` levels down), with size, mtime and etag when
        the store has one; keys relative to ``key``. Symlinks are followed: a link to a file is that file (its
        size and mtime); a link to a device or a FIFO, like the FIFO itself, comes back with ``regular=False``
        (never to be read)."""
        base = self.path(key)
        # all of fsspec's listing cache, not just `base`: s3fs drops a path and its parents, and its find()
        # would reuse a stale listing of a subfolder in a long-lived process (new objects never seen)
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(base, maxdepth=maxdepth, detail=True)
        except FileNotFoundError:
            return
        except Exception as exc:
            raise self.failure("listing", key, exc) from exc
        prefix = base.rstrip("/") + "/"
        for path, info in sorted(found.items()):
            if info.get("type") == "directory" or not path.startswith(prefix):
                continue
            if info.get("islink"):  # a directory listing stats the link itself: follow it to what it names
                try:
                    info = self.fs.info(path)
                except OSError:  # a dangling link: nothing to read
                    info = {**info, "type": "other"}
            yield ObjectInfo(
                key=path[len(prefix):],
                size=int(info.get("size") or 0),
                mtime=_mtime(info),
                etag=_etag(info),
                regular=info.get("type", "file") == "file",
                storage_class=info.get("StorageClass") or info.get("storage_class"),
            )

    def _entries(self, key: str) -> list[dict]:
        """What lies directly below ``key`` (fsspec's detailed ls, fresh), without ``key`` itself."""
        base = self.path(key)
        self.fs.invalidate_cache(base)
        try:
            entries = self.fs.ls(base, detail=True)
        except FileNotFoundError:
            return []
        except Exception as exc:
            raise self.failure("listing", key, exc) from exc
        return [e for e in entries if e["name"].rstrip("/") != base.rstrip("/")]

    @staticmethod
    def _name(entry: dict) -> str:
        return entry["name"].rstrip("/").rsplit("/", 1)[-1]

    def folders(self, key: str = "") -> list[str]:
        """Names of the folders (common prefixes) directly below ``key``."""
        return sorted(self._name(e) for e in self._entries(key) if e.get("type") == "directory")

    def list_names(self, key: str, *, temp: bool = False) -> list[str]:
        """Names directly below ``key`` (files and folders); empty when it does not exist.

        A local write killed before its rename leaves a hidden temp file (``TEMP_PREFIX``); those are
        left out unless ``temp`` is set (the writer's sweep asks for them to delete them).
        """
        names = (self._name(e) for e in self._entries(key))
        return sorted(n for n in names if temp or not n.startswith(TEMP_PREFIX))

    # -- reading -----------------------------------------------------------------------------
    @store_io("reading")
    def read_bytes(self, key: str, limit: int | None = None) -> bytes:
        """The object's bytes; with ``limit``, at most that many (the caller refuses a longer object)."""
        path = self.path(key)
        if limit is not None and self.is_local:  # never a buffer of `limit` bytes for a small file
            with open(path, "rb") as fh:
                return fh.read(min(limit, os.fstat(fh.fileno()).st_size + 1))
        # one (ranged) GET on an object store, as without a limit
        return self.fs.cat_file(path, start=None if limit is None else 0, end=limit)

    def read_json(self, key: str) -> Any:
        """A JSON record, read at most to its size limit and checked for nesting (RecordError otherwise)."""
        return parse_record(self.read_bytes(key, limit=MAX_RECORD_BYTES + 1), f"{redact(self.url)}: {key}")

    @store_io("reading")
    def read_table(self, key: str, columns: list[str] | None = None, max_rows: int | None = None) -> pa.Table:
        with self.fs.open(self.path(key), "rb") as fh:  # with max_rows, the footer's count is checked first
            if max_rows is not None and (rows := pq.ParquetFile(fh).metadata.num_rows) > max_rows:
                raise RecordError(f"{redact(self.url)}: {key}: {rows:,} rows, more than the {max_rows:,} expected")
            fh.seek(0)
            return pq.read_table(fh, columns=columns)

    @contextlib.contextmanager
    def parquet_file(self, key: str) -> Iterator[pq.ParquetFile]:
        """A Parquet object opened to be read in parts (its footer, the row groups a caller picks, batches of some
        columns), never whole: a local file by its path, an object store's object by ranged reads."""
        handle, file = self._open_parquet(key)
        try:
            yield file
        finally:
            file.close()
            if handle is not None:
                handle.close()

    @store_io("reading")
    def _open_parquet(self, key: str) -> tuple[Any, pq.ParquetFile]:
        if self.is_local:  # Arrow's own file: its reader threads never call back into Python
            return None, parquet_reader(self.path(key))
        handle = self.fs.open(self.path(key), "rb")
        try:
            return handle, parquet_reader(handle)
        except BaseException:
            handle.close()
            raise

    @store_io("reading")
    def read_parquet_metadata(self, key: str) -> dict[str, str]:
        """The key-value metadata of a Parquet file, from its footer only."""
        with self.fs.open(self.path(key), "rb") as fh:
            meta = pq.read_metadata(fh).metadata or {}
        return {k.decode(): v.decode() for k, v in meta.items()}

    # -- writing -----------------------------------------------------------------------------
    def _atomic_local(self, path: str, fill: Callable[[Any], Any]) -> None:
        # a hidden temp file in the same folder, fsynced, renamed over the target: a kill never leaves half a file
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f"{TEMP_PREFIX}{uuid.uuid4().hex}-{os.path.basename(path)}")
        with open(tmp, "wb") as fh:
            fill(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    @store_io("writing")
    def write_bytes(self, key: str, data: bytes) -> None:
        """Make ``key`` appear whole or not at all: a single PUT is atomic on object stores, a local disk gets
        a temp file renamed over the target."""
        if self.is_local:
            self._atomic_local(self.path(key), lambda fh: fh.write(data))
        else:
            self.fs.pipe_file(self.path(key), data)

    @store_io("writing")
    def put_file(self, key: str, local_path: str) -> None:
        """Upload a local file too large to hold, whole or not at all (an object store's multipart upload is
        visible only once completed)."""
        if self.is_local:
            with open(local_path, "rb") as src:
                self._atomic_local(self.path(key), lambda fh: shutil.copyfileobj(src, fh, 1 << 20))
        else:
            self.fs.put_file(local_path, self.path(key))

    def write_json(self, key: str, obj: Any) -> None:
        self.write_bytes(key, json.dumps(obj, indent=2, sort_keys=True, default=str).encode())

    def write_table(self, key: str, table: pa.Table) -> bytes:
        """Write a Parquet file atomically; returns its bytes (callers checksum them). Vector columns
        (fixed-size lists) skip dictionary encoding: embeddings are near-unique floats, where a dictionary
        only adds bytes (and would hide what float16 saves)."""
        sink = io.BytesIO()
        plain = {f.name for f in table.schema if pa.types.is_fixed_size_list(f.type)}
        pq.write_table(table, sink, compression="zstd",
                       use_dictionary=[f.name for f in table.schema if f.name not in plain] if plain else True)
        data = sink.getvalue()
        self.write_bytes(key, data)
        return data

    @store_io("creating")
    def create_exclusive(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if it does not exist (O_EXCL locally, If-None-Match on S3)."""
        path = self.path(key)
        if self.is_local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            with self.fs.open(path, "xb") as fh:
                fh.write(data)
        except FileExistsError:
            return False
        except OSError as exc:
            # s3fs makes a 412 a FileExistsError only when the answer names its condition, which S3 and moto
            # do and SeaweedFS does not; a 409 (S3: a racing conditional write won) it leaves an OSError too.
            if not self.is_local and self._precondition_failed(exc):
                return False
            raise
        return True

    @store_io("deleting")
    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(key))

    @store_io("deleting")
    def delete_tree(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(key), recursive=True)

    @store_io("opening")
    def open_output(self, key: str):
        path = self.path(key)
        if self.is_local:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        return self.fs.open(path, "wb")


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def open_location(url: str, *, must_exist: bool = False, what: str = "location",
                  follow_links: bool = False) -> Location:
    """Open ``url`` and, when asked, check it is reachable, turning client errors into one clear line."""
    loc = Location(url, follow_links=follow_links)
    if not must_exist:
        return loc

    def probe(path: str) -> bool:
        try:
            return loc.fs.exists(path)
        except Exception as exc:  # botocore/aiohttp errors vary; the point is one readable line
            raise StorageError(f"{what} {redact(loc.url)} is unreachable: {type(exc).__name__}: {redact(exc)}"
                               + what_to_do(loc.endpoint, exc)) from exc

    # An S3 prefix "exists" only once it holds objects: an empty prefix in an existing bucket is fine.
    if not (probe(loc.root) or (not loc.is_local and probe(loc.root.split("/", 1)[0]))):
        raise StorageError(f"{what} {redact(loc.url)} does not exist")
    return loc


def read_url(url: str) -> bytes:
    """Bytes of one object named by a full URL or path (a query image, a queries file)."""
    url = _normalise(url)
    fs, path = _url_to_fs(url)
    try:
        return fs.cat_file(path)
    except FileNotFoundError as exc:
        raise StorageError(f"{redact(url)} does not exist") from exc
    except Exception as exc:  # denied, expired signature, unreachable: one line, nothing secret in it
        raise StorageError(f"reading {redact(url)} failed: {one_line(exc)}") from exc
