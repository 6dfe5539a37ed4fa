"""A model change from the catalogue against one from kept pixels, in one run, on ~1200 px product JPEGs.

    .venv/bin/python bench/bench_kept_pixels.py [--images 1500] [--side 256] [--workdir DIR] [--json]

The catalogue: `imgest.images.demo.product_photos` at 1100-1300 px (real photos, JPEG q85-95, a third progressive, every
fifth stored sideways with an EXIF turn, every tenth a PNG cut-out) in a local folder. Every command runs through
the CLI, as a user runs it, against one Prefect server:

  1. `imgest ingest --model efficientnet-lite0` into two stores, one with `--keep-pixels SIDE`, one without: what
     keeping the copies costs the nightly (images/s), and the copies' storage against the originals'.
  2. `imgest reencode --model efficientnet-lite0-gem` into each store: from the catalogue (the store without
     copies) and from kept pixels (the other), twice each, alternating (catalogue, kept, kept, catalogue): images/s,
     objects and bytes read, the gate's figures. The ratio of the medians is the figure to read.
  3. `imgest reencode --model efficientnet-lite2` (its preprocessing needs a shorter side of 297) into the store with
     copies: it reads the originals, and its summary says why.

Beside the runs, on 64 of the catalogue's photos in this process, one core: core-ms per image of what a decode worker
does from the original (read, hash, reduced decode, preprocess) and from the copy (decode, preprocess), and of the
encoder (OpenVINO bf16 at batch 8).
Runtime, precision, batch size and JPEG decoder are fixed for every run (`FIXED`: OpenVINO bf16, the runtime a CPU
run chooses, at batch 8, simplejpeg): what differs between the runs is where the pixels come from.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.bench_nightly_scale import IMGEST, PrefectServer  # noqa: E402

NEW_MODEL, LARGER, BASE = "efficientnet-lite0-gem", "efficientnet-lite2", "efficientnet-lite0"
FIXED = ["--runtime", "openvino", "--precision", "bf16", "--batch-size", "8", "--decoder", "simplejpeg"]


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def write_catalogue(folder: str, images: int) -> int:
    from imgest.images.demo import product_photos

    total = 0
    for key, data in product_photos(images, seed=11, sides=(1100, 1300)).items():
        path = os.path.join(folder, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data)
        total += len(data)
    return total


def imgest(args: list[str], env: dict) -> dict:
    """One CLI command; its run summary (the newest file under the store's runs/)."""
    started = time.perf_counter()
    done = subprocess.run([IMGEST, *args], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"imgest {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    store = args[args.index("--store") + 1]
    runs = sorted(f for f in os.listdir(os.path.join(store, "runs")) if f.endswith(".json"))
    with open(os.path.join(store, "runs", runs[-1])) as fh:
        summary = json.load(fh)
    summary["command_seconds"] = round(time.perf_counter() - started, 2)
    return summary


def folder_bytes(path: str) -> tuple[int, int]:
    files = [os.path.join(d, f) for d, _, names in os.walk(path) for f in names]
    return len(files), sum(os.path.getsize(f) for f in files)


def core_ms(catalogue: str, store: str, side: int) -> dict:
    """Core-ms per image (this thread's CPU time) of a decode worker's work from the original and from its copy,
    and of the new model's encode at batch 8 (OpenVINO bf16, as the runs), on 64 photos."""
    import numpy as np
    import pyarrow.parquet as pq

    from imgest import encoders
    from imgest.images.decode import decode_image
    from imgest.images.decoders import recorded
    from imgest.state.committed import load_state
    from imgest.state.models import list_models
    from imgest.storage import Location

    spec = encoders.resolve(NEW_MODEL)
    encoder = encoders.load(spec, "cpu", "openvino", "bf16")  # as the runs encode (FIXED)
    need = encoder.decode_side
    base = next(m["slug"] for m in list_models(Location(store)) if m["name"] == BASE)
    decoder = recorded(Location(store), base)
    state = load_state(Location(store), base)
    rows = state.query("SELECT item_id, shard FROM state WHERE status = 'live' ORDER BY item_id LIMIT 64")
    copies = {}
    for shard in set(rows["shard"].to_pylist()):
        for folder, _, names in os.walk(os.path.join(store, "pixels")):
            if f"{shard}.parquet" in names and "model=" + base in folder:
                table = pq.read_table(os.path.join(folder, f"{shard}.parquet"), columns=["item_id", "bytes"])
                copies.update(zip(table["item_id"].to_pylist(), table["bytes"].to_pylist()))
    ids = [i for i in rows["item_id"].to_pylist() if i in copies]

    def timed(fn) -> float:
        start = time.thread_time()
        for item_id in ids:
            fn(item_id)
        return (time.thread_time() - start) * 1e3 / len(ids)

    def original(item_id: str):
        with open(os.path.join(catalogue, item_id), "rb") as fh:
            data = fh.read()
        hashlib.sha256(data).hexdigest()
        return encoder.preprocess(decode_image(data, min_side=need, decoder=decoder))

    def from_copy(item_id: str):
        return encoder.preprocess(decode_image(copies[item_id], min_side=need))

    batch = np.stack([from_copy(i) for i in ids[:8]])
    encoder.encode_images(batch)  # warm-up
    start = time.process_time()  # the runtime's own threads too
    for _ in range(4):
        encoder.encode_images(batch)
    encode = (time.process_time() - start) * 1e3 / 32
    timed(original), timed(from_copy)  # warm-up: file cache, decoder tables
    originals = statistics.median(timed(original) for _ in range(3))
    copies_ms = statistics.median(timed(from_copy) for _ in range(3))
    return {"images": len(ids), "decode_original_core_ms": round(originals, 2),
            "decode_copy_core_ms": round(copies_ms, 2),
            "encode_core_ms": round(encode, 2), "source_decoder": decoder}


def reencode_row(summary: dict, catalogue_bytes: int, pixel_files: int, pixel_bytes: int) -> dict:
    kept = summary.get("kept_pixels") or {}
    from_kept = kept.get("from_kept", 0)
    read = summary["encoded"] - from_kept
    return {"images_per_second": summary["images_per_second"], "encoded": summary["encoded"],
            "from_kept": from_kept, "from_catalogue": read, "runtime": f"{summary['runtime']} {summary['precision']}",
            "batch_size": summary["batch_size"], "command_seconds": summary["command_seconds"],
            "objects_read": read + (pixel_files if from_kept else 0),
            "bytes_read": round(catalogue_bytes * read / max(summary["encoded"], 1))
            + (pixel_bytes if from_kept else 0),
            "reads": kept.get("reads"), "why": kept.get("why"), "gate": kept.get("gate")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=1500)
    parser.add_argument("--side", type=int, default=256)
    parser.add_argument("--workdir")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="imgest-kept-")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    catalogue = os.path.join(work, "catalogue")
    say(f"writing {args.images} product photos to {catalogue}")
    catalogue_bytes = write_catalogue(catalogue, args.images)
    stores = {"catalogue": os.path.join(work, "store-originals"), "kept": os.path.join(work, "store-kept")}
    result: dict = {"date": datetime.now(UTC).date().isoformat(), "images": args.images, "side": args.side,
                    "catalogue_bytes": catalogue_bytes, "cpu_cores": len(os.sched_getaffinity(0))}
    with PrefectServer(os.path.join(work, "prefect")) as server:
        env = {**os.environ, **server.env}
        ingest = {}
        for name, store in (("catalogue", stores["catalogue"]), ("kept", stores["kept"])):
            keep = ["--keep-pixels", str(args.side)] if name == "kept" else []
            say(f"ingest {BASE} into {store} {' '.join(keep)}")
            summary = imgest(["ingest", "--catalogue", catalogue, "--store", store, "--model", BASE, *keep, *FIXED],
                             env)
            ingest[name] = {"images_per_second": summary["images_per_second"],
                            "runtime": f"{summary['runtime']} {summary['precision']}",
                            "kept_pixels": summary.get("kept_pixels")}
        pixel_files, pixel_bytes = folder_bytes(os.path.join(stores["kept"], "pixels"))
        result["ingest"] = ingest
        result["storage"] = {"catalogue_bytes": catalogue_bytes, "copies_bytes": pixel_bytes,
                             "copies_files": pixel_files, "copy_bytes_per_image": round(pixel_bytes / args.images),
                             "original_bytes_per_image": round(catalogue_bytes / args.images),
                             "copies_over_originals": round(pixel_bytes / catalogue_bytes, 4)}
        runs: dict[str, list[dict]] = {"catalogue": [], "kept": []}
        for attempt, name in enumerate(("catalogue", "kept", "kept", "catalogue")):
            store = stores[name]
            work_store = f"{store}-run{attempt}"
            shutil.rmtree(work_store, ignore_errors=True)
            shutil.copytree(store, work_store)  # each run re-encodes from the same store, as a first change does
            say(f"reencode {NEW_MODEL} from the {name} ({work_store})")
            summary = imgest(["reencode", "--catalogue", catalogue, "--store", work_store, "--model", NEW_MODEL,
                              *FIXED], env)
            runs[name].append(reencode_row(summary, catalogue_bytes, pixel_files, pixel_bytes))
            shutil.rmtree(work_store, ignore_errors=True)
        result["reencode"] = runs
        median = {name: statistics.median(r["images_per_second"] for r in rows) for name, rows in runs.items()}
        result["kept_over_catalogue_images_per_second"] = round(median["kept"] / median["catalogue"], 3)
        say(f"reencode {LARGER} in the store with copies")
        larger_store = f"{stores['kept']}-larger"
        shutil.copytree(stores["kept"], larger_store)
        summary = imgest(["reencode", "--catalogue", catalogue, "--store", larger_store, "--model", LARGER, *FIXED],
                         env)
        result["larger_side"] = reencode_row(summary, catalogue_bytes, pixel_files, pixel_bytes) | {"model": LARGER}
    result["core_ms"] = core_ms(catalogue, stores["kept"], args.side)
    say(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
