"""Near-duplicates at the fixed threshold against the calibrated one, per model and kind of catalogue.

    OPENBLAS_CORETYPE=Haswell .venv/bin/python bench/bench_duplicates.py [--art 200] [--photos 28] [--json OUT]

Two catalogues from `imgest.images.demo.planted_duplicates`, each with copies planted in it by that function (not by
the calibration's own copier): a JPEG re-encode at quality 60-70 with transparency composited on white, a
resize to 0.5-2x, a crop of 3-8% per side, in turn, for half of the originals:
  - photos: distinct photos (scikit-image's, and the halves of the wider ones) at 800-1600 px, every fourth a
    PNG cut-out with transparency;
  - art: 64 px product art with transparency (Fashion-MNIST items, coloured, background transparent).
Each is ingested and indexed for two models: efficientnet-lite0 (the default, real weights) and raw-pixels.
Then `duplicates` runs with `--threshold 0.97` and with the calibrated default.

Reported for each (catalogue, model, threshold):
  - planted recall: share of planted copies grouped with their original;
  - wrong groups: groups holding two different originals, and pair precision: found pairs between one
    original's pictures over all found pairs;
  - the calibration's own figures (recall on its copies, precision against nearest-other pairs, the hash
    rule) for the calibrated run.
The planted copies are the held-out check: the calibration never sees which items are copies.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _outcome(report: dict, planted: dict[str, str], store: str) -> dict:
    """Read from the run's Parquet report and its pairs (the JSON lists only the first groups)."""
    import pyarrow.parquet as pq

    members = pq.read_table(os.path.join(store, report["key"]), columns=["group", "item_id"]).to_pydict()
    group_of = dict(zip(members["item_id"], members["group"]))
    groups: dict[int, set[str]] = {}
    for item, group in group_of.items():
        groups.setdefault(group, set()).add(item)
    joined = pq.read_table(os.path.join(store, report["pairs_key"]), columns=["a", "b", "signal"]).to_pydict()
    pairs = list(zip(joined["a"], joined["b"]))
    found = sum(1 for copy, original in planted.items()
                if copy in group_of and group_of.get(original) == group_of[copy])
    right = sum(1 for a, b in pairs if planted.get(a, a) == planted.get(b, b))
    return {"threshold": report["threshold"], "source": report["threshold_source"],
            "planted_recall": round(found / len(planted), 3), "found": found, "planted": len(planted),
            "wrong_groups": sum(1 for items in groups.values() if len({planted.get(i, i) for i in items}) > 1),
            "pair_precision": round(right / len(pairs), 3) if pairs else None, "pairs": len(pairs),
            "signals": sorted(set(joined["signal"])), "calibration": report["calibration"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--art", type=int, default=200, help="originals of small art")
    parser.add_argument("--photos", type=int, default=28, help="distinct photos (28 at most)")
    parser.add_argument("--models", default="efficientnet-lite0,raw-pixels")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    from imgest.config import DuplicatesConfig, IndexConfig, IngestConfig
    from imgest.flows.build_index import build_index
    from imgest.flows.duplicates import duplicates
    from imgest.flows.ingest import ingest
    from imgest.images.demo import planted_duplicates

    results = []
    with tempfile.TemporaryDirectory() as tmp, prefect_test_harness(server_startup_timeout=90):
        for kind, originals in (("photos", args.photos), ("art", args.art)):
            files, planted = planted_duplicates(kind, originals, originals // 2, seed=11)
            cat = os.path.join(tmp, kind, "cat")
            for key, data in files.items():
                os.makedirs(os.path.dirname(os.path.join(cat, key)), exist_ok=True)
                with open(os.path.join(cat, key), "wb") as fh:
                    fh.write(data)
            for model in args.models.split(","):
                store = os.path.join(tmp, kind, f"store-{model}")
                ingest(IngestConfig(catalogue=cat, store=store, model=model, batch_size="16"))
                build_index(IndexConfig(store=store, model=model, alias="serving"))
                for threshold in (0.97, None):
                    started = time.perf_counter()
                    report = duplicates(DuplicatesConfig(store=store, threshold=threshold))
                    row = {"catalogue": kind, "images": len(files), "model": model,
                           "seconds": round(time.perf_counter() - started, 1), **_outcome(report, planted, store)}
                    results.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "calibration"}), flush=True)
                    if row["calibration"] and threshold is None:
                        c = row["calibration"]
                        print(f"  calibration: recall {c['recall']} precision {c['precision']} by kind "
                              f"{c['recall_by_kind']} hash {c['hash_signal']}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
