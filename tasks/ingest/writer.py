"""Shard writer: rows of one shard -> a Parquet file in the shard format, then its commit marker (written last)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa

from imgest.encoders import EncoderSpec
from imgest.state.clock import now_iso
from imgest.state.layout import commit_key, shard_key
from imgest.state.lock import Fence
from imgest.state.pixels import PixelShardWriter
from imgest.state.shards import DTYPES, shard_schema
from imgest.storage import Location
from imgest.tasks.ingest.plan import ShardPlan, WorkItem


@dataclass
class ShardResult:
    shard: str
    encoded: int = 0
    derived: int = 0  # of the encoded: a head applied to stored base embeddings, nothing decoded
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (item_id, reason), failed ones included
    failed: int = 0  # of the rejected: transient reasons, retried on the next run
    unchanged: int = 0  # signature moved, bytes identical
    revived: int = 0  # came back with their tombstone's bytes: the old row serves again, nothing encoded
    vanished: int = 0  # deleted between listing and reading; the next run tombstones it
    bytes: int = 0
    sha256: str | None = None
    seconds: float = 0.0
    encode_seconds: float = 0.0
    wait_seconds: float = 0.0  # encoder idle, waiting on decode
    runtime: str = ""  # what ran the encoder (imgest/encoders/runtimes.py) and at which precision
    precision: str = ""
    decoder: str = ""  # the JPEG decoder that made its vectors (imgest/images/decoders.py); "" for text
    decode_side: int | None = None  # ... down to this shorter side (0: whole images; None: text)
    from_kept: int = 0  # of the encoded: decoded from kept copies, not the catalogue's originals
    kept_written: int = 0  # copies in the shard's pixel file (kept pixels)
    kept_bytes: int = 0
    kept_faults: list[str] = field(default_factory=list)  # pixel files skipped (damaged, planted), copies not made
    decode: str = ""  # where decoding ran: "1 decode process, torch 1 thread(s)" (decode_workers.py plan_decode)
    worker: str = ""  # host:pid of the process that encoded it
    started: str = ""  # UTC ISO times of the encode, for a timeline of the workers
    finished: str = ""


def _object_fields(item: WorkItem, content_hash: str) -> dict:
    return {"item_id": item.item_id, "uri": item.uri, "etag": item.etag, "size": item.size,
            "mtime": item.mtime, "content_hash": content_hash}


class ShardWriter:
    """Collects one shard's outcome; ``flush`` makes it durable and then visible."""

    def __init__(self, store: Location, spec: EncoderSpec, plan: ShardPlan, fence: Fence | None = None,
                 dtype: str = "float32", runtime: str = "torch", precision: str = "fp32", decoder: str | None = None,
                 keep_side: int = 0, decode_side: int | None = None):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
        self.store, self.spec, self.plan, self.fence, self.dtype = store, spec, plan, fence, dtype
        self.result = ShardResult(shard=plan.name, runtime=runtime, precision=precision, decoder=decoder or "",
                                  decode_side=decode_side if decoder else None)
        self._rows: list[dict] = []
        self._vectors: list[np.ndarray] = []
        self._rejected: list[dict] = []
        self._unchanged: list[dict] = []
        self._revived: list[dict] = []
        self._pixels = PixelShardWriter(keep_side) if keep_side else None

    def keep(self, item: WorkItem, content_hash: str, copy: tuple[bytes, int, int] | None, from_kept: bool) -> None:
        """An item to be encoded: its kept copy (kept pixels) goes to the shard's pixel file."""
        self.result.from_kept += from_kept
        if self._pixels is not None and copy is not None:
            self._pixels.add(item.item_id, content_hash, copy[1], copy[2], copy[0])

    def add(self, items: list[tuple[WorkItem, str]], embeddings: np.ndarray) -> None:
        if embeddings.shape != (len(items), self.spec.dim):
            raise ValueError(f"encoder returned {embeddings.shape}, expected ({len(items)}, {self.spec.dim})")
        self._rows.extend(_object_fields(item, h) for item, h in items)
        self._vectors.append(np.asarray(embeddings, np.float32))

    def reject(self, item: WorkItem, content_hash: str | None, reason: str, transient: bool = False) -> None:
        self._rejected.append({**_object_fields(item, content_hash), "reason": reason, "transient": transient})
        self.result.rejected.append((item.item_id, reason))
        self.result.failed += transient

    def revive(self, item: WorkItem, content_hash: str) -> None:
        self._revived.append({**_object_fields(item, content_hash), "shard": item.revive_shard})
        self.result.revived += 1

    def unchanged(self, item: WorkItem, content_hash: str) -> None:
        self._unchanged.append(_object_fields(item, content_hash))
        self.result.unchanged += 1

    def vanished(self, item: WorkItem) -> None:
        self.result.vanished += 1

    def _table(self) -> pa.Table:
        vectors = np.concatenate(self._vectors) if self._vectors else np.zeros((0, self.spec.dim), np.float32)
        now = datetime.now(UTC)
        n = len(self._rows)
        schema = shard_schema(self.spec, self.dtype)
        columns = {name: [r[name] for r in self._rows] for name in ("item_id", "uri", "content_hash", "etag",
                                                                    "size", "mtime")}
        flat = pa.array(vectors.reshape(-1).astype(DTYPES[self.dtype][0]), DTYPES[self.dtype][1])
        table = pa.table({
            **{k: columns[k] for k in ("item_id", "uri", "content_hash")},
            "model_id": [self.spec.model_id] * n,
            "embedding": pa.FixedSizeListArray.from_arrays(flat, self.spec.dim),
            **{k: columns[k] for k in ("etag", "size", "mtime")},
            "run_id": [self.plan.run_id] * n,
            "encoded_at": pa.array([now] * n, pa.timestamp("us", tz="UTC")),
        }, schema=schema)
        meta = dict(schema.metadata or {})
        meta.update({b"imgest.run_id": self.plan.run_id.encode(), b"imgest.shard": self.plan.name.encode(),
                     b"imgest.rows": str(n).encode(), b"imgest.runtime": self.result.runtime.encode(),
                     b"imgest.precision": self.result.precision.encode()})
        if self.result.from_kept:  # of its rows, decoded from kept copies of the originals
            meta[b"imgest.from_kept_pixels"] = str(self.result.from_kept).encode()
        if self.result.decoder:  # what decoded its images: a model's vectors are made by one (shard_decoder)
            meta[b"imgest.decoder"] = self.result.decoder.encode()
        if self.result.decode_side is not None:
            meta[b"imgest.decode_side"] = str(self.result.decode_side).encode()
        return table.replace_schema_metadata(meta)

    def flush(self) -> ShardResult:
        """Write the Parquet file (atomically), then the commit marker that makes it count."""
        self.result.encoded = len(self._rows)
        self.result.finished = datetime.now(UTC).isoformat(timespec="microseconds")
        if self._rows:
            data = self.store.write_table(shard_key(self.spec.slug, self.plan.name), self._table())
            self.result.bytes, self.result.sha256 = len(data), hashlib.sha256(data).hexdigest()
        marker = {
            "run_id": self.plan.run_id,
            "shard": self.plan.name,
            "model_id": self.spec.model_id,
            "dtype": self.dtype,
            "runtime": self.result.runtime,
            "precision": self.result.precision,
            "decoder": self.result.decoder or None,
            "decode_side": self.result.decode_side,
            "file": shard_key(self.spec.slug, self.plan.name) if self._rows else None,
            "rows": len(self._rows),
            "bytes": self.result.bytes,
            "sha256": self.result.sha256,
            "created": now_iso(),
            "worker": self.result.worker,
            "started": self.result.started,
            "finished": self.result.finished,
            "encoded": self._rows,
            "rejected": self._rejected,
            "unchanged": self._unchanged,
            "revived": self._revived,
        }
        # one fence check per shard, before the marker: a writer that lost the lock leaves at most an
        # unreferenced file, which the holder's next run removes
        marker["pixels"] = self._publish_pixels()
        self._check()
        self.store.write_json(commit_key(self.spec.slug, self.plan.name), marker)
        return self.result

    def _publish_pixels(self) -> dict | None:
        """The shard's pixel file, uploaded before its marker (a kill leaves at most an unreferenced file)."""
        if self._pixels is None:
            return None
        published = self._pixels.publish(self.store, self.spec.slug, self.plan.name)
        if published is not None:
            self.result.kept_written, self.result.kept_bytes = published["rows"], published["bytes"]
        return published

    def _check(self) -> None:
        if self.fence is not None:
            self.fence.check(self.store)
