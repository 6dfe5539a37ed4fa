"""The caption retriever's reads of a metadata snapshot at catalogue size: the text listing (every row's text
composed, hashed and joined with the image listing) and one shard's texts on a night where 1% of the rows changed.

What it makes (under --workdir, kept between runs of the same size and row group): a snapshot of N rows as the
store keeps it (sorted by item_id; title ~60 and description ~400 characters, from bench/scale_catalogue.py) written
with row groups of --row-group rows, and the image listing of its N items as a Parquet file (as a catalogue's
listing is spilled). Then, in this process, sampled every 20 ms (VmRSS): `text_listing` over the snapshot opened
through the store, and `shard_texts` for the first 2,000 of the rows the 1% night changes (which lie spread over
the catalogue, one in a hundred).

    .venv/bin/python bench/bench_caption_texts.py --rows 1000000 --workdir /tmp/imgest-texts --json

prints {"rows": N, "listing": {"seconds": s, "rss_start_mb": m, "peak_mb": m}, "shard": {...}} as its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.scale_catalogue import Catalogue, metadata_blocks, metadata_changed, say  # noqa: E402

SHARD = 2000


def rss_mb() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) >> 10
    return 0


class Peak:
    """The highest VmRSS of this process while the block runs, sampled every 20 ms."""

    def __enter__(self) -> Peak:
        self.start = self.peak = rss_mb()
        self.running, self.began = True, time.perf_counter()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, rss_mb())
            time.sleep(0.02)

    def __exit__(self, *exc) -> None:
        self.seconds = round(time.perf_counter() - self.began, 2)
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, rss_mb())

    def figures(self) -> dict:
        return {"seconds": self.seconds, "rss_start_mb": self.start, "peak_mb": self.peak,
                "peak_over_start_mb": self.peak - self.start}


def setup(rows: int, group: int, work: str) -> tuple[str, str]:
    """The snapshot (in a store folder, where the store keeps it) and the image listing file; made once."""
    from imgest.images.listing import LISTING_SCHEMA
    from imgest.state.metadata import snapshot_key

    store = os.path.join(work, f"store-{rows}-{group}")
    snapshot = os.path.join(store, snapshot_key(1))
    listing = os.path.join(work, f"listing-{rows}.parquet")
    cat = Catalogue(rows)  # its listed objects number `rows` (as many new as deleted)
    if not os.path.exists(snapshot):
        os.makedirs(os.path.dirname(snapshot), exist_ok=True)
        t, writer = time.perf_counter(), None
        for block in metadata_blocks(cat, 1):
            block = block.append_column("row_hash", pa.array(np.full(len(block), "0" * 64)))
            writer = writer or pq.ParquetWriter(snapshot + ".part", block.schema, compression="zstd")
            writer.write_table(block, row_group_size=group)
        writer.close()
        os.replace(snapshot + ".part", snapshot)
        say(f"snapshot of {rows:,} rows in {time.perf_counter() - t:.0f} s")
    if not os.path.exists(listing):
        file = pq.ParquetFile(snapshot)
        with pq.ParquetWriter(listing + ".part", LISTING_SCHEMA) as writer:
            for g in range(file.metadata.num_row_groups):
                keys = file.read_row_group(g, columns=["item_id"])["item_id"]
                n = len(keys)
                writer.write_table(pa.table({
                    "key": keys, "key_ok": pa.array(np.ones(n, bool)), "size": pa.array(np.ones(n, np.int64)),
                    "mtime": pa.nulls(n, pa.float64()), "etag": pa.nulls(n, pa.string()),
                    "storage_class": pa.nulls(n, pa.string())}, schema=LISTING_SCHEMA))
        os.replace(listing + ".part", listing)
    return store, listing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, required=True, help="snapshot rows (catalogue items)")
    parser.add_argument("--row-group", type=int, default=65_536, help="the snapshot's rows per row group")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    store_dir, listing_file = setup(args.rows, args.row_group, args.workdir)

    from imgest import encoders
    from imgest.images.listing import Listing
    from imgest.state.metadata import snapshot_key
    from imgest.storage import Location
    from imgest.tasks.ingest.encode_text import shard_texts, text_listing

    spec, store = encoders.resolve("minilm-l6"), Location(store_dir)
    images = Listing(catalogue="/catalogue", files=[listing_file])
    with store.parquet_file(snapshot_key(1)) as snapshot, Peak() as listed:
        texts, left_out = text_listing(images, snapshot, spec)
    kept = len(texts)
    del texts
    positions = np.flatnonzero(metadata_changed(np.arange(args.rows)))[:SHARD]
    file = pq.ParquetFile(os.path.join(store_dir, snapshot_key(1)))
    ids = pa.concat_arrays([file.read_row_group(g, columns=["item_id"])["item_id"].combine_chunks()
                            for g in range(file.metadata.num_row_groups)]).take(pa.array(positions))
    items = ids.to_pylist()  # one shard's ids
    del ids
    with store.parquet_file(snapshot_key(1)) as snapshot, Peak() as read:
        shard = shard_texts(snapshot, spec, items)
    result = {"rows": args.rows, "row_group": args.row_group, "row_groups": file.metadata.num_row_groups,
              "snapshot_mb": round(os.path.getsize(os.path.join(store_dir, snapshot_key(1))) / 2**20, 1),
              "date": datetime.now(UTC).isoformat(timespec="seconds"),
              "listing": {**listed.figures(), "kept": kept, "left_out": left_out},
              "shard": {**read.figures(), "items": len(items), "texts": len(shard.texts),
                        "rows_read": shard.rows_read, "groups_read": shard.groups_read,
                        "span_rows": int(positions[-1] - positions[0] + 1)}}
    if not args.json:
        print(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
