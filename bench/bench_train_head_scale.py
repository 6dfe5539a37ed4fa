"""A supervised head trained at catalogue size: a label file covering every item of a store of N items, and what
`imgest train-head --labels` holds to train on it.

The store is the scale rehearsals' (bench/scale_catalogue.py: N items of `raw-pixels-4`, d = 48, in shards of
2,000, one full snapshot; written once under --workdir and reused); the label file gives every item its pattern's
prototype as its class (1,024 classes, the clusters the vectors make). Then, each as one command on the bench's own
Prefect server, with one sampler on its process tree (RSS summed every 0.1 s, bench/tree_sampler.py):

  train-head   imgest train-head --labels <every item> --epochs E [--max-items M] --json: the label file streamed
               to Parquet, joined with the live set in DuckDB (M of the labelled items drawn there, with
               --max-items), their vectors read by shard, the head trained and saved
  live set     (--compare) the way train-head read the store before: load_live_vectors, every live vector, id, uri
               and hash, in a process of its own

    .venv/bin/python bench/bench_train_head_scale.py --objects 1000000 --workdir /tmp/imgest-heads-scale --json

prints {"objects": N, "stages": {"<stage>": {"seconds": s, "peak_rss_mb": m, ...}}, ...} as its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.csv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.bench_model_change import last_json, sampled  # noqa: E402
from bench.bench_nightly_scale import IMGEST, PrefectServer  # noqa: E402
from bench.scale_catalogue import CHUNK, MODEL, PROTOTYPES, Catalogue, say, write_store  # noqa: E402

LOAD_LIVE = """
import sys
from imgest.state.live import load_live_vectors
from imgest.state.models import find_model
from imgest.storage import Location
store = Location(sys.argv[1])
model = find_model(store, sys.argv[2])
live = load_live_vectors(store, model["slug"], int(model["dim"]))
print(len(live), live.vectors.nbytes)
"""


def labels_file(cat: Catalogue, path: str) -> None:
    """`item_id,label` for every item: its pattern's prototype (scale_catalogue.Catalogue.patterns), CHUNK rows at a
    time."""
    with pyarrow.csv.CSVWriter(path, pa.schema([("item_id", pa.string()), ("label", pa.string())]),
                               write_options=pyarrow.csv.WriteOptions(quoting_style="none")) as writer:
        for start in range(0, cat.n, CHUNK):
            ids = np.arange(start, min(start + CHUNK, cat.n))
            prototype = (ids * 2654435761) % PROTOTYPES
            writer.write_table(pa.table({"item_id": cat.keys(ids),
                                         "label": np.char.add("p", prototype.astype(str)).tolist()}))


def setup(cat: Catalogue, work: str) -> tuple[str, str]:
    store, labels = os.path.join(work, "store"), os.path.join(work, "labels.csv")
    ready = os.path.join(work, "ready.json")
    if os.path.exists(ready):
        with open(ready) as fh:
            if json.load(fh)["objects"] != cat.n:
                raise SystemExit(f"{work} holds a store of another size; use another --workdir")
        return store, labels
    start = time.perf_counter()
    say(f"writing a store of {cat.n:,} items and a label file covering every one")
    write_store(cat, store, with_shards=True)
    labels_file(cat, labels)
    with open(ready, "w") as fh:
        json.dump({"objects": cat.n, "seconds": round(time.perf_counter() - start, 1)}, fh)
    return store, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, required=True, help="catalogue size N (every item labelled)")
    parser.add_argument("--workdir", help="kept between runs: the store and label file are reused")
    parser.add_argument("--epochs", type=int, default=2, help="train-head --epochs")
    parser.add_argument("--max-items", type=int, default=0,
                        help="train-head --max-items: train on a seeded sample of this many labelled items (0: all)")
    parser.add_argument("--compare", action="store_true",
                        help="also measure load_live_vectors, the way train-head read the store before")
    parser.add_argument("--json", action="store_true", help="the result as one JSON line, last")
    args = parser.parse_args()
    if args.objects < 1000:
        raise SystemExit("--objects: at least 1000")
    work = args.workdir or tempfile.mkdtemp(prefix="imgest-heads-scale-")
    os.makedirs(work, exist_ok=True)
    cat = Catalogue(args.objects)
    store, labels = setup(cat, work)
    stages = {}
    with PrefectServer(os.path.join(work, "prefect")) as prefect:
        env = prefect.env | {"OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE", "Haswell")}
        stages["train-head"] = sampled("train-head", [
            IMGEST, "train-head", "--store", store, "--labels", labels, "--base-model", MODEL, "--loss", "infonce",
            "--epochs", str(args.epochs), "--patience", str(args.epochs), "--max-items", str(args.max_items),
            "--json"], env, work)
        trained = last_json(os.path.join(work, "train-head.log"))
        if args.compare:
            stages["live set"] = sampled("live set", [sys.executable, "-c", LOAD_LIVE, store, MODEL], env, work)
    counts = trained["config"]["counts"]
    result = {"objects": args.objects, "model": MODEL, "epochs": args.epochs,
              "date": datetime.now(UTC).isoformat(timespec="seconds"), "cores": os.cpu_count(),
              "labelled_live_items": trained["labelled_live_items"], "max_items": args.max_items,
              "labelled_items_read": trained["labelled_items_read"], "labels": counts["labels"],
              "train_items": counts["train_items"], "val_items": counts["val_items"],
              "best_epoch": trained["config"]["validation"]["best_epoch"],
              "recall@1": trained["config"]["validation"]["recall@1"],
              "base_recall@1": trained["config"]["validation"]["base_recall@1"],
              "vectors_mb": round(args.objects * 48 * 4 / 2**20, 1), "stages": stages,
              "peak_rss_mb": max(s["peak_rss_mb"] for s in stages.values())}
    if not args.json:
        print("\n| stage | seconds | peak RSS MB |\n|---|---:|---:|")
        for stage, row in stages.items():
            print(f"| {stage} | {row['seconds']} | {row['peak_rss_mb']} |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
