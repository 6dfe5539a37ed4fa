"""Conditional writes: compare-and-swap of the store's records replaced in place (aliases, the migration window).

A version token is opaque to callers: the ETag on an object store, a digest of the bytes on a local disk.
Both name the content, so a record that must never come back to an earlier version carries something that
only grows (a history, an event list). The local swap holds an flock on the record's folder across compare
and rename: writers on one machine exclude each other; NFS and other network disks are not supported
(their flock may not be shared between clients).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from typing import Any

from imgest.redact import redact
from imgest.storage.faults import store_io
from imgest.storage.records import MAX_RECORD_BYTES, RecordError

TEMP_PREFIX = ".tmp-"  # a local atomic write's file before its rename (see Location.write_bytes)




class ConditionalWrites:
    """The compare-and-swap half of a storage `Location` (it provides path, fs, is_local, url, failure)."""

    def read_versioned(self, key: str, limit: int = MAX_RECORD_BYTES) -> tuple[bytes | None, str | None]:
        """``key``'s bytes and their version token for `write_if` / `delete_if`; (None, None) when it does not
        exist; RecordError when it is over ``limit`` bytes (refused before it is read). On an object store both
        come from one GET, so the token is the version of these very bytes."""
        data, token, size = self._read_versioned(key, limit)
        if size > limit:
            raise RecordError(f"{redact(self.url)}: {key}: {size:,} bytes or more, over the {limit:,}-byte limit "
                              "of a record")
        return data, token

    @store_io("reading")
    def _read_versioned(self, key: str, limit: int) -> tuple[bytes | None, str | None, int]:
        path = self.path(key)
        if self.is_local:
            try:
                with open(path, "rb") as fh:
                    data = fh.read(limit + 1)
            except FileNotFoundError:
                return None, None, 0
            return data, self._digest(data), len(data)
        from fsspec.asyn import sync

        bucket, name, _ = self.fs.split_path(path)

        async def get() -> tuple[bytes | None, str | None, int]:
            try:
                response = await self.fs._call_s3("get_object", Bucket=bucket, Key=name)
            except FileNotFoundError:
                return None, None, 0
            try:
                size = int(response.get("ContentLength") or 0)
                if size > limit:
                    return None, response["ETag"], size
                data = await response["Body"].read()
                return data, response["ETag"], len(data)
            finally:
                response["Body"].close()

        return sync(self.fs.loop, get)

    @store_io("writing")
    def write_if(self, key: str, data: bytes, token: str | None) -> str | None:
        """Write ``data`` only if ``key`` is still the version `token` names (None: only if it does not exist);
        S3: `If-Match` / `If-None-Match: *` on the PUT. Returns the new version's token, or None when the record
        changed since it was read, and then nothing was written. Of writers holding one token, one succeeds."""
        path = self.path(key)
        if self.is_local:
            return self._digest(data) if self._local_swap(path, data, token) else None
        condition = {"IfNoneMatch": "*"} if token is None else {"IfMatch": token}
        response = self._s3_if(path, "put_object", Body=data, **condition)
        return None if response is None else response["ETag"]

    @store_io("deleting")
    def delete_if(self, key: str, token: str) -> bool:
        """Delete ``key`` only if it is still the version `token` names; False when it changed or is gone.
        (S3: `If-Match` on the DELETE; an S3-compatible server that ignores it deletes unconditionally.)"""
        path = self.path(key)
        if self.is_local:
            return self._local_swap(path, None, token)
        return self._s3_if(path, "delete_object", IfMatch=token) is not None

    def _s3_if(self, path: str, operation: str, **kwargs: Any) -> dict | None:
        """One conditional S3 call; None when its condition failed (412, or 409 when a concurrent conditional
        write won; If-None-Match meeting an object, If-Match meeting none), and then nothing changed."""
        bucket, name, _ = self.fs.split_path(path)
        try:
            return self.fs.call_s3(operation, Bucket=bucket, Key=name, **kwargs)
        except (FileExistsError, FileNotFoundError):
            return None
        except OSError as exc:
            if self._precondition_failed(exc):
                return None
            raise
        finally:
            self.fs.invalidate_cache(path)

    def write_json_if(self, key: str, obj: Any, token: str | None) -> str | None:
        """`write_if` of a JSON record, laid out as `write_json` lays it out."""
        return self.write_if(key, json.dumps(obj, indent=2, sort_keys=True, default=str).encode(), token)

    def _local_swap(self, path: str, data: bytes | None, token: str | None) -> bool:
        """If the file is still the version `token` names, put ``data`` in its place (None: delete it).
        The new bytes go to a fsynced temp file first; only the compare and the rename hold the flock."""
        import fcntl  # POSIX

        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = None
        if data is not None:
            tmp = os.path.join(folder, f"{TEMP_PREFIX}{uuid.uuid4().hex}-{os.path.basename(path)}")
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        lock = os.open(folder, os.O_RDONLY)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed
            try:
                with open(path, "rb") as fh:
                    current = self._digest(fh.read())
            except FileNotFoundError:
                current = None
            if current != token:
                return False
            if tmp is None:
                os.remove(path)
            elif token is None:
                try:
                    os.link(tmp, path)  # never over a file made meanwhile by a writer that takes no flock
                except FileExistsError:
                    return False
            else:
                os.replace(tmp, path)
            os.fsync(lock)  # the rename itself survives a crash
            return True
        finally:
            os.close(lock)
            if tmp is not None and os.path.exists(tmp):
                os.remove(tmp)

    @staticmethod
    def _digest(data: bytes) -> str:
        return "sha256:" + hashlib.sha256(data).hexdigest()

    @staticmethod
    def _precondition_failed(exc: BaseException) -> bool:
        """S3 answered 412 (the version changed) or 409 (a concurrent conditional write won): nothing landed."""
        while exc is not None:
            response = getattr(exc, "response", None)  # botocore's ClientError, s3fs's cause
            if isinstance(response, dict) and str(response.get("Error", {}).get("Code", "")) in (
                    "PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                return True
            exc = exc.__cause__
        return False


