"""Index follows the catalogue: nights of churn on a store of 1M clustered vectors, each night's version
updated in place (remove_ids / add_with_ids) against a full rebuild, through the build-index flow.

    OPENBLAS_CORETYPE=Haswell .venv/bin/python bench/bench_index_update.py --n 1000000 --nights 10

A store is written directly (shards, a snapshot, the card of `raw-pixels-13`, d = 507, whose vectors are
seeded instead of encoded); each night
1% of the live items change content (a new vector), 0.5% are new, 0.5% are deleted, as one ingest run
would commit them. New vectors come from the same clusters (the catalogue keeps its shape). Recall is
measured here on one common probe set per night (1,000 live items, exact top-10 over all live vectors),
at each version's served nprobe, beside the recall its card reports.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.bench_index import clustered  # noqa: E402
from imgest.config import IndexConfig  # noqa: E402


def model_card(name: str) -> dict:
    """The card of a model imgest knows (a store's model must be one: its records never choose one), written
    without its weights: the benchmarks seed its vectors themselves."""
    from imgest import encoders

    return encoders.resolve(name).describe()


MODEL = model_card("raw-pixels-13")  # d = 507


def write_shard(store, name: str, ids: list[str], vectors: np.ndarray, hashes: list[str],
                slug: str = MODEL["slug"]) -> None:
    from imgest.state.layout import shard_key

    d = vectors.shape[1]
    table = pa.table({"item_id": ids, "uri": [f"s3://catalogue/{i}" for i in ids], "content_hash": hashes,
                      "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel(), pa.float32()), d)})
    store.write_table(shard_key(slug, name), table)


def seed_store(store, x: np.ndarray, shard_rows: int = 50_000, model: dict = MODEL) -> None:
    """One committed run holding `x` as the live vectors of `model` (a model card: slug, model_id, ...)."""
    from imgest.state.committed import (
        LIVE,
        CatalogueState,
        ItemState,
        new_run_id,
        write_model_card,
        write_snapshot,
    )

    write_model_card(store, {**model, "dim": x.shape[1]})
    run = new_run_id(1)
    items = {}
    for s, start in enumerate(range(0, len(x), shard_rows)):
        stop = min(len(x), start + shard_rows)
        name = f"part-{run}-{s:05d}"
        ids = [f"item/{i:08d}" for i in range(start, stop)]
        write_shard(store, name, ids, x[start:stop], [f"h{i}-0" for i in range(start, stop)], model["slug"])
        for i, item in enumerate(ids, start):
            items[item] = ItemState(item, f"s3://catalogue/{item}", LIVE, None, 1, 0.0, f"h{i}-0", name, run)
    write_snapshot(store, CatalogueState(model["slug"], items), run, {"seeded": len(x)})


def night(store, rng, pool: np.ndarray, used: int, seq: int, n_next: int,
          model: dict = MODEL) -> tuple[int, int, dict]:
    """One night's churn committed as one run: returns (pool rows used, next new item number, counts)."""
    from imgest.state.committed import DELETED, LIVE, ItemState, load_state, new_run_id, write_snapshot

    state = load_state(store, model["slug"])
    live = sorted(k for k, v in state.items.items() if v.status == LIVE)
    n = len(live)
    picks = rng.choice(n, size=n // 100 + n // 200, replace=False)
    changed, deleted = [live[i] for i in picks[:n // 100]], [live[i] for i in picks[n // 100:]]
    new = [f"item/{i:08d}" for i in range(n_next, n_next + n // 200)]
    run = new_run_id(seq)
    name = f"part-{run}-00000"
    rows = changed + new
    vectors = pool[used:used + len(rows)]
    hashes = [f"h{used + j}-{seq}" for j in range(len(rows))]
    write_shard(store, name, rows, vectors, hashes, model["slug"])
    for item, h in zip(rows, hashes):
        state.items[item] = ItemState(item, f"s3://catalogue/{item}", LIVE, None, 1, float(seq), h, name, run)
    for item in deleted:
        state.items[item].status = DELETED
    write_snapshot(store, state, run, {"changed": len(changed), "new": len(new), "deleted": len(deleted)})
    return used + len(rows), n_next + len(new), {"changed": len(changed), "new": len(new), "deleted": len(deleted)}


def common_recall(stores, cards: list[dict], queries: int = 1000) -> list[float]:
    """recall@10 of each version at its served nprobe, on one probe set of the current live vectors."""
    from imgest.retrieval.versions import open_index
    from imgest.state.live import load_live_vectors
    from imgest.tasks.index.tuning import exact_neighbours, knn_recall, sample_queries

    live = load_live_vectors(stores[0], MODEL["slug"], cards[0]["d"])
    qids = sample_queries(len(live), queries, seed=42)
    truth, _ = exact_neighbours(live.vectors, qids, 10)
    out = []
    for store, card in zip(stores, cards):
        opened = open_index(store, card["slug"], card["version"])
        assert opened.item_ids == live.item_ids, "both versions number the live items alike"
        _, found = opened.search(live.vectors[qids], 11)
        out.append(round(knn_recall(live.vectors, qids, found, truth, 10), 4))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--nights", type=int, default=10)
    parser.add_argument("--memory", default="1G", help="index budget: 1G makes the rule pick IVF,SQ8 at 1M x 512")
    parser.add_argument("--rebuild-every", type=int, default=5, help="also time a full rebuild on these nights")
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from imgest.flows.build_index import build_index
    from imgest.storage import Location

    churn = args.nights * (args.n // 100 + args.n // 200) + args.n // 10
    x = clustered(args.n + churn, MODEL["dim"])
    work = tempfile.mkdtemp(prefix="imgest-bench-update-")
    store = Location(os.path.join(work, "store"))
    t0 = time.perf_counter()
    seed_store(store, x[:args.n])
    print(f"seeded {args.n:,} x {MODEL['dim']} in {time.perf_counter() - t0:.0f} s at {work}", flush=True)
    common = {"store": store.url, "model": MODEL["slug"], "memory": args.memory, "alias": None}

    t0 = time.perf_counter()
    first = build_index(IndexConfig(**common))["card"]
    full0 = time.perf_counter() - t0
    print(f"v{first['version']} {first['factory']}: full build {full0:.1f} s (card: train "
          f"{first['times']['train_seconds']} s, add {first['times']['add_seconds']} s), nprobe "
          f"{first['search']['value']}, recall@10 {first['recall']['recall@10']}", flush=True)
    rng = np.random.default_rng(7)
    used, n_next = args.n, args.n
    rows = []
    for night_no in range(1, args.nights + 1):
        used, n_next, counts = night(store, rng, x, used, night_no + 1, n_next)
        t0 = time.perf_counter()
        card = build_index(IndexConfig(**common))["card"]
        update_s = time.perf_counter() - t0
        row = {"night": night_no, **counts, "n": card["n"], "method": card["lineage"]["method"],
               "why": card["lineage"]["why"], "seconds": round(update_s, 1), "nprobe": card["search"]["value"],
               "card_recall": card["recall"]["recall@10"], "probes": card["recall"]["queries"]}
        cards = [card]
        stores = [store]
        if night_no % args.rebuild_every == 0 or night_no == 1:
            # the rebuild goes to a hard-linked copy of the store, so that the next night still updates the
            # chain of updated versions (a build takes the newest version as its base)
            twin = Location(os.path.join(work, f"rebuilt-{night_no}"))
            subprocess.run(["cp", "-al", store.path(), twin.path()], check=True)
            t0 = time.perf_counter()
            fresh = build_index(IndexConfig(**{**common, "store": twin.url}, rebuild=True))["card"]
            row["rebuild_seconds"] = round(time.perf_counter() - t0, 1)
            row["rebuild_nprobe"], row["rebuild_card_recall"] = fresh["search"]["value"], fresh["recall"]["recall@10"]
            cards.append(fresh)
            stores.append(twin)
        recalls = common_recall(stores, cards)
        for twin in stores[1:]:
            shutil.rmtree(twin.path())
        row["recall"] = recalls[0]
        if len(recalls) > 1:
            row["rebuild_recall"] = recalls[1]
        rows.append(row)
        print(row, flush=True)

    print(f"\n## Index updated in place vs rebuilt: N={args.n:,}, d={MODEL['dim']}, {first['factory']}, budget "
          f"{args.memory}; nightly churn 1% changed + 0.5% new + 0.5% deleted\n")
    print(f"First full build: {full0:.1f} s (flow wall time, store on local disk).\n")
    print("| night | live N | version built by | s | nprobe | recall@10 (common probes) | card recall (its probes) | "
          "full rebuild s | rebuild nprobe | rebuild recall@10 | update / rebuild time |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        rb = r.get("rebuild_seconds")
        ratio = f"{r['seconds'] / rb:.3f}" if rb else "-"
        print(f"| {r['night']} | {r['n']:,} | {r['method']} | {r['seconds']} | {r['nprobe']} | {r['recall']} | "
              f"{r['card_recall']} ({r['probes']}) | {rb or '-'} | {r.get('rebuild_nprobe', '-')} | "
              f"{r.get('rebuild_recall', '-')} | {ratio} |")
    print("\nwhy, per night: " + "; ".join(f"{r['night']}: {r['why']}" for r in rows))


if __name__ == "__main__":
    main()
