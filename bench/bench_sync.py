"""Syncing a vector database: a first full sync of a 100k-item store per target (Milvus Lite, Qdrant's local
mode, LanceDB on a folder), then a night where 1% of the items changed, against `imgest export` of the whole model;
and the cost of switching the target's name to another model (what promote and rollback do).

    .venv/bin/python bench/bench_sync.py --n 100000 --d 512

The store is written directly through the project's writers (shards, a committed snapshot, a model card, as
bench_index_update.py does) with random unit vectors: the sync reads shards and sends rows, it never looks at what
the vectors mean. Each engine gets its own fresh folder; times are wall clock on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.bench_index_update import seed_store, write_shard  # noqa: E402

# a store names only models this installation has: a built-in name, with the bench's own slugs and ids (looked up
# by slug, so the name is never resolved)
MODELS = [{"slug": f"synthetic-{k}", "model_id": f"synthetic/random-{k}@bench", "name": "raw-pixels",
           "family": "synthetic"} for k in ("a", "b")]


def unit(rng, n: int, d: int) -> np.ndarray:
    x = rng.standard_normal((n, d), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def change(store, rng, slug: str, share: float, d: int) -> int:
    """One night: `share` of the live items get new content (a new vector), committed as one run."""
    from imgest.state.committed import LIVE, ItemState, load_state, new_run_id, write_snapshot

    state = load_state(store, slug)
    live = sorted(k for k, v in state.items.items() if v.status == LIVE)
    picks = sorted(live[i] for i in rng.choice(len(live), size=int(len(live) * share), replace=False))
    run = new_run_id(2)
    name = f"part-{run}-00000"
    hashes = [f"{item}-2" for item in picks]
    write_shard(store, name, picks, unit(rng, len(picks), d), hashes, slug)
    for item, h in zip(picks, hashes):
        state.items[item] = ItemState(item, f"s3://catalogue/{item}", LIVE, None, 1, 2.0, h, name, run)
    write_snapshot(store, state, run, {"changed": len(picks)})
    return len(picks)


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--engines", default="milvus,qdrant,lancedb")
    parser.add_argument("--switch", action=argparse.BooleanOptionalAction, default=True,
                        help="also sync a second model and time switching the name to it")
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from imgest.config import SyncConfig
    from imgest.state.export import export_live
    from imgest.storage import Location
    from imgest.tasks.sync.run import sync
    from imgest.tasks.sync.targets import Model, open_target, parse_target

    root = tempfile.mkdtemp(prefix="imgest-bench-sync-")
    rng = np.random.default_rng(0)
    try:
        store = Location(f"{root}/store")
        for model in MODELS if args.switch else MODELS[:1]:
            seed_store(store, unit(rng, args.n, args.d), model=model)
        out, full_export = timed(export_live, store.url, MODELS[0]["slug"], f"{root}/export.parquet")
        rows = []

        def url_of(engine: str) -> str:
            return {"milvus": f"milvus://{root}/{engine}/vectors.db/products",
                    "qdrant": f"qdrant://{root}/{engine}/products",
                    "lancedb": f"lancedb://{root}/{engine}/products"}[engine]

        def run(engine: str, model: dict):
            return timed(sync, SyncConfig(store=store.url, to=url_of(engine), model=model["slug"], batch=args.batch))

        for engine in args.engines.split(","):
            os.makedirs(f"{root}/{engine}", exist_ok=True)
            first, first_s = run(engine, MODELS[0])
            _, noop_s = run(engine, MODELS[0])
            row = {"engine": engine, "n": args.n, "d": args.d, "full_s": round(first_s, 1),
                   "full_rows_per_s": round(first["upserted"] / first_s), "unchanged_s": round(noop_s, 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        changed = change(store, rng, MODELS[0]["slug"], 0.01, args.d)
        _, night_export = timed(export_live, store.url, MODELS[0]["slug"], f"{root}/export2.parquet")
        for row in rows:
            engine = row["engine"]
            night, night_s = run(engine, MODELS[0])
            assert night["upserted"] == changed, night
            row.update(night_changed=changed, night_s=round(night_s, 2),
                       night_rows_per_s=round(changed / night_s), export_s=round(night_export, 1))
            if args.switch:  # a candidate synced beside, then the name moved to it and back
                _, cand_s = run(engine, MODELS[1])
                target = open_target(parse_target(url_of(engine)))
                try:
                    models = [Model(m["model_id"], m["slug"], args.d) for m in MODELS]
                    target.open(models[1], None)
                    _, there_s = timed(target.point, models[1])
                    assert target.answers() == models[1].model_id
                    target.open(models[0], None)
                    _, back_s = timed(target.point, models[0])
                    assert target.answers() == models[0].model_id
                finally:
                    target.close()
                row.update(candidate_s=round(cand_s, 1), switch_s=round(there_s, 3), switch_back_s=round(back_s, 3))
            print(json.dumps(row), flush=True)
        print(json.dumps({"export_rows": out["rows"], "first_export_s": round(full_export, 1),
                          "night_export_s": round(night_export, 1),
                          "export_mb": round(os.path.getsize(f"{root}/export2.parquet") / 2**20, 1)}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
