"""Which index a nightly should keep: an HNSW graph built again every night against an IVF index updated in
place, at growing N, through the build-index flow (what a night runs).

    OPENBLAS_CORETYPE=Haswell .venv/bin/python bench/bench_index_kind.py --sizes 25000,50000,100000,200000

For each N a store of N clustered vectors of the default model's d (1280; bench/bench_index_update.py's
store: shards, a snapshot, the model's card, the vectors seeded) is indexed as IVF,SQ8 (`--kind ivfsq8`), one
night of churn is committed (1% changed, 0.5% new, 0.5% deleted), and the night's index is made both ways from
the same state: the IVF version updated in place (`build-index`, no --rebuild), and the HNSW32 graph built from
scratch (`--kind hnsw --rebuild`, what the nightly does every night with an HNSW index: a graph cannot remove a
vector). Both are tuned to the same recall target
on their own probes; the table gives their flow wall times, ratio and recall. `imgest`'s automatic kind takes
IVF over HNSW from the size where the rebuild's cost passes the threshold recorded in tasks/index/choice.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.bench_index import clustered  # noqa: E402
from bench.bench_index_update import model_card, night, seed_store  # noqa: E402


def one_size(n: int, model: dict, memory: str, target: float, work: str) -> dict:
    from imgest.config import IndexConfig
    from imgest.flows.build_index import build_index
    from imgest.storage import Location

    d = model["dim"]
    x = clustered(n + n // 50, d)
    store = Location(os.path.join(work, f"store-{n}"))
    seed_store(store, x[:n], model=model)
    common = {"store": store.url, "model": model["slug"], "memory": memory, "alias": None, "target_recall": target}
    build_index(IndexConfig(**common, kind="ivfsq8"))
    night(store, np.random.default_rng(7), x, n, 2, n, model)
    twin = Location(os.path.join(work, f"twin-{n}"))
    subprocess.run(["cp", "-al", store.path(), twin.path()], check=True)

    t0 = time.perf_counter()
    updated = build_index(IndexConfig(**common, kind="ivfsq8"))["card"]
    update_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    graph = build_index(IndexConfig(**{**common, "store": twin.url}, kind="hnsw", rebuild=True))["card"]
    rebuild_s = time.perf_counter() - t0
    shutil.rmtree(store.path())
    shutil.rmtree(twin.path())
    if updated["lineage"]["method"] != "update":
        raise SystemExit(f"N={n}: the IVF version was not updated: {updated['lineage']['why']}")
    return {"n": updated["n"], "d": d, "ivf_factory": updated["factory"], "ivf_update_s": round(update_s, 1),
            "ivf_recall": updated["recall"]["recall@10"], "ivf_met": updated["recall"]["met"],
            "hnsw_factory": graph["factory"], "hnsw_rebuild_s": round(rebuild_s, 1),
            "hnsw_recall": graph["recall"]["recall@10"], "hnsw_met": graph["recall"]["met"],
            "rebuild_over_update": round(rebuild_s / update_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="25000,50000,100000,200000", help="catalogue sizes N, comma-separated")
    parser.add_argument("--model", default="efficientnet-lite0",
                        help="whose card the store holds (its d; vectors are seeded, no weights needed)")
    parser.add_argument("--memory", default="4G", help="the budget: HNSW must fit it at every N")
    parser.add_argument("--target-recall", type=float, default=0.95)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    work = tempfile.mkdtemp(prefix="imgest-bench-kind-")
    rows = []
    try:
        for n in (int(s) for s in args.sizes.split(",")):
            rows.append(one_size(n, model_card(args.model), args.memory, args.target_recall, work))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not args.json:
        print("\n| N | IVF update s | recall@10 | HNSW rebuild s | recall@10 | rebuild / update |")
        print("|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['n']:,} | {r['ivf_update_s']} | {r['ivf_recall']} | {r['hnsw_rebuild_s']} | "
                  f"{r['hnsw_recall']} | {r['rebuild_over_update']} |")
    print(json.dumps({"model": args.model, "memory": args.memory, "target_recall": args.target_recall, "sizes": rows}))


if __name__ == "__main__":
    main()
