"""Catalogue metadata at catalogue size: the nightly's metadata stage alone, first night and a 1%-changed night.

    OPENBLAS_CORETYPE=Haswell .venv/bin/python bench/bench_metadata.py --items 1000000 --workdir /tmp/imgest-meta-1m
    OPENBLAS_CORETYPE=Haswell .venv/bin/python bench/bench_metadata.py --items 10000000 --workdir /tmp/imgest-meta-10m

A metadata file of N products, in item_id order or with --shuffled out of it (item_id, product_id, title,
category, price, colour, description: titles of 30-80 characters, descriptions of 150-450) is generated once
under --workdir as Parquet, then written as CSV and JSONL by DuckDB, with a second file in which 1% of the rows
have a new title and price. For each format,
a fresh process runs what the nightly's `store-metadata` task runs (`store_metadata`: read, check, hash, compare
with the last snapshot and with the catalogue listing of the N keys, held as Parquet files on local disk, write
the snapshot) into a fresh store on local disk: the first night, then the 1% night. Reported per night: wall
seconds, the process's peak RSS (sampled every 0.1 s), the report's counts, and the snapshots in the store.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

BLOCK = 500_000
ADJECTIVES = ["classic", "slim", "relaxed", "waterproof", "lightweight", "padded", "organic", "vintage", "cropped",
              "oversized", "quilted", "ribbed", "stretch", "tailored", "recycled", "knitted"]
MATERIALS = ["canvas", "leather", "wool", "cotton", "linen", "denim", "suede", "nylon", "cashmere", "fleece"]
NOUNS = ["sneaker", "ankle boot", "trench coat", "tote bag", "crew-neck sweater", "shirt dress", "chino trousers",
         "puffer jacket", "scarf", "backpack", "loafer", "hoodie", "wrap skirt", "parka", "sandal", "blazer"]
COLOURS = ["black", "white", "navy", "red", "olive", "beige", "grey", "burgundy", "camel", "sky blue", "green"]
CATEGORIES = ["shoes", "coats", "bags", "knitwear", "dresses", "trousers", "jackets", "accessories", "tops"]
SENTENCES = [
    "Made from responsibly sourced materials with a soft brushed finish.",
    "A regular fit that sits comfortably at the waist.",
    "Features two front pockets and an inner zip compartment for essentials.",
    "Machine washable at 30 degrees; do not tumble dry.",
    "The sole is cushioned for all-day comfort and has a grippy rubber tread.",
    "Designed in our studio and finished by hand.",
    "Pair it with straight-leg jeans for an easy weekend look.",
    "Lined with a breathable fabric that keeps its shape wash after wash.",
    "The model is 185 cm tall and wears a size M.",
    "Adjustable straps let you wear it over the shoulder or across the body.",
    "Water-repellent coating keeps light showers off.",
    "Ribbed cuffs and hem hold the warmth in on colder days.",
    "Tonal stitching and metal hardware with a brushed finish.",
    "Part of our permanent collection, restocked every season.",
]


def generate(path: str, items: int, changed: int, shuffled: bool, seed: int = 7) -> None:
    """N rows as a catalogue export holds them, written a block at a time; every 100th row among the first
    `changed` * 100 has a new title and price. `shuffled`: blocks and the rows inside them out of item_id order."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    def words(pool: list[str], picks) -> pa.Array:
        return pc.take(pa.array(pool), pa.array(picks))

    schema = None
    writer = None
    starts = list(range(0, items, BLOCK))
    if shuffled:
        starts = [starts[i] for i in np.random.default_rng(seed).permutation(len(starts))]
    for start in starts:
        n = np.arange(start, min(items, start + BLOCK))
        rng = np.random.default_rng(seed + start)
        ids = pc.binary_join_element_wise("products/", pc.utf8_lpad(pa.array(n).cast(pa.string()), 9, "0"),
                                          ".jpg", "")
        colour = words(COLOURS, rng.integers(0, len(COLOURS), len(n)))
        title = pc.binary_join_element_wise(
            words(ADJECTIVES, rng.integers(0, len(ADJECTIVES), len(n))),
            words(MATERIALS, rng.integers(0, len(MATERIALS), len(n))),
            words(NOUNS, rng.integers(0, len(NOUNS), len(n))),
            pa.array(["in"] * len(n)), colour,
            pc.binary_join_element_wise("(style ", pa.array(rng.integers(1000, 99999, len(n))).cast(pa.string()),
                                        ")", ""), " ")
        price = np.round(rng.uniform(9, 400, len(n)), 2)
        keep = rng.integers(3, 7, len(n))  # 3 to 6 sentences: ~150-450 characters
        parts = [words(SENTENCES, rng.integers(0, len(SENTENCES), len(n))) for _ in range(6)]
        joined = [pc.binary_join_element_wise(*parts[:k], " ") for k in range(3, 7)]
        description = pc.choose(pa.array(keep - 3), *joined)
        if changed:
            hit = (n % 100 == 0) & (n // 100 < changed)
            price = np.where(hit, price + 1, price)
            title = pc.if_else(pa.array(hit), pc.binary_join_element_wise(title, "(new season)", " "), title)
        table = pa.table({"item_id": ids, "product_id": pc.utf8_lpad(pa.array(n // 3).cast(pa.string()), 8, "0"),
                          "title": title, "category": words(CATEGORIES, rng.integers(0, len(CATEGORIES), len(n))),
                          "price": price, "colour": colour, "description": description})
        if shuffled:
            table = table.take(pa.array(rng.permutation(table.num_rows)))
        if writer is None:
            schema = table.schema
            writer = pq.ParquetWriter(path, schema, compression="zstd")
        writer.write_table(table.cast(schema), row_group_size=125_000)
    writer.close()


def convert(parquet: str, fmt: str) -> str:
    import duckdb

    target = parquet[:-len(".parquet")] + "." + fmt
    if not os.path.exists(target):
        options = "(HEADER, DELIMITER ',')" if fmt == "csv" else "(FORMAT json)"
        with duckdb.connect(config={"memory_limit": "1GB", "preserve_insertion_order": True}) as con:
            con.execute(f"COPY (SELECT * FROM read_parquet('{parquet}')) TO '{target}.tmp' {options}")
        os.replace(target + ".tmp", target)
    return target


def listing_files(work: str, items: int) -> list[str]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from imgest.images.listing import LISTING_SCHEMA

    path = os.path.join(work, "listing.parquet")
    if not os.path.exists(path):
        with pq.ParquetWriter(path + ".tmp", LISTING_SCHEMA, compression="zstd") as writer:
            for start in range(0, items, BLOCK):
                n = np.arange(start, min(items, start + BLOCK))
                keys = pc.binary_join_element_wise(
                    "products/", pc.utf8_lpad(pa.array(n).cast(pa.string()), 9, "0"), ".jpg", "")
                writer.write_table(pa.table({
                    "key": keys, "key_ok": pa.array(np.ones(len(n), bool)), "size": pa.array(n * 0 + 500_000),
                    "mtime": pa.array(np.ones(len(n))), "etag": keys, "storage_class": pa.nulls(len(n), pa.string())},
                    schema=LISTING_SCHEMA))
        os.replace(path + ".tmp", path)
    return [path]


CHILD = """
import json, sys, time
from imgest.images.listing import Listing
from imgest.state.metadata import store_metadata
from imgest.storage import Location
store, url, listing = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
start = time.perf_counter()
report = store_metadata(Location(store), url, Listing("bench", files=listing))
print(json.dumps({"seconds": time.perf_counter() - start, "report": report.to_dict()}))
"""


def night(store: str, url: str, listing: list[str]) -> dict:
    from tree_sampler import TreeSampler

    env = {**os.environ, "PYTHONPATH": ROOT}
    start = time.time()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, store, url, json.dumps(listing)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = TreeSampler(proc.pid)
    sampler.start()
    out, err = proc.communicate()
    sampler.stop()
    if proc.returncode:
        raise SystemExit(f"the night failed:\n{err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    result["wall_s"] = round(time.time() - start, 1)
    result["peak_rss_mb"] = round(max((s[1] for s in sampler.samples), default=0) / 2**20)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, required=True)
    parser.add_argument("--workdir", required=True, help="the generated files are kept here and reused")
    parser.add_argument("--formats", default="csv,jsonl,parquet")
    parser.add_argument("--shuffled", action="store_true", help="rows out of item_id order (the snapshot is sorted)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    tag = "-shuffled" if args.shuffled else ""
    first, second = (os.path.join(args.workdir, f"{name}{tag}.parquet") for name in ("night1", "night2"))
    for path, changed in ((first, 0), (second, args.items // 100)):
        if not os.path.exists(path):
            generate(path + ".tmp.parquet", args.items, changed, args.shuffled)
            os.replace(path + ".tmp.parquet", path)
    listing = listing_files(args.workdir, args.items)
    results = {"items": args.items, "shuffled": args.shuffled,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "formats": {}}
    for fmt in args.formats.split(","):
        urls = [p if fmt == "parquet" else convert(p, fmt) for p in (first, second)]
        store = os.path.join(args.workdir, f"store-{fmt}{tag}")
        shutil.rmtree(store, ignore_errors=True)
        nights = [night(store, url, listing) for url in urls]
        snapshots = sorted(os.listdir(os.path.join(store, "metadata", "snapshots")))
        results["formats"][fmt] = {"file_mb": round(os.path.getsize(urls[0]) / 2**20), "first": nights[0],
                                   "one_percent": nights[1], "snapshots": snapshots}
        if not args.json:
            for name, r in zip(("first night", "1% night"), nights):
                rep = r["report"]
                print(f"{fmt:8s} {name:12s} {r['seconds']:8.1f} s {r['peak_rss_mb']:6d} MB  new {rep['new']:>10,} "
                      f"changed {rep['changed']:>8,} unchanged {rep['unchanged']:>10,} written {rep['written']}")
            print(f"{fmt:8s} snapshots: {snapshots}")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
