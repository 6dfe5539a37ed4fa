"""PQ under a RAM budget: for budgets of 1/4, 1/8 and 1/16 of the vectors' fp32 size, the index imgest's rule
picks (PQ codes in RAM, float16 re-rank vectors on local disk), built, tuned to recall@10 >= 0.95, written and
opened as `imgest search` opens it (codes copied to RAM, re-rank vectors memory-mapped from the file), then
measured on 1,000 held-out corpus queries (not the tuning ones): recall@10 against exact search at the served
(nprobe, k_factor), QPS (the 1,000 queries as one batch, page cache warm), the footprint (RAM and disk bytes
as the card gives them, and the anonymous memory the opened index added to the process), build time; beside it
the same codes without the re-rank (k_factor 1), what the rule served before. Each budget runs in its own
process.

    OPENBLAS_CORETYPE=Haswell .venv/bin/python bench/bench_pq.py --n 1000000 --d 512
    OPENBLAS_CORETYPE=Haswell .venv/bin/python bench/bench_pq.py --real-store /tmp/lite0-10k/store
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))


def served(r: dict) -> str:
    return r["nprobe"] if r["variant"] == "autofaiss" else f"nprobe={r['nprobe']}, k_factor={r['k_factor']}"


def rss_anon_mib() -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("RssAnon:")) / 1024


def vectors(args) -> np.ndarray:
    if args.real_store:
        from imgest.state.live import load_live_vectors
        from imgest.state.models import find_model
        from imgest.storage import Location

        store = Location(args.real_store)
        card = find_model(store, "efficientnet-lite0")
        return np.ascontiguousarray(load_live_vectors(store, card["slug"], card["dim"]).vectors)
    from bench_index import clustered

    return clustered(args.n, args.d)


def child(args) -> None:
    import faiss

    from imgest.tasks.index.build import build
    from imgest.tasks.index.card import footprint
    from imgest.tasks.index.choice import choose_index
    from imgest.tasks.index.tuning import exact_neighbours, knn_recall, sample_queries, tune_search

    x = vectors(args)
    n, d = x.shape
    budget = 4 * n * d // args.fraction
    qids = sample_queries(n, 1000, seed=1)  # the tuning sweep samples with seed 0: these are held out
    truth, _ = exact_neighbours(x, qids, 10)
    choice = choose_index(n, d, budget, disk="unlimited")
    if args.no_opq:  # the ablation: the same PQ without the rotation the rule put in front
        choice = replace(choice, factory=choice.factory.split(",", 1)[1],
                         estimated_bytes=choice.estimated_bytes - 4 * d * d)
    if args.with_opq and not choice.factory.startswith("OPQ"):  # the other way: a rotation the rule left out
        m = int(re.search(r",PQ(\d+)", choice.factory).group(1))
        choice = replace(choice, factory=f"OPQ{m}_{d}," + choice.factory,
                         estimated_bytes=choice.estimated_bytes + 4 * d * d)
    index, times = build(x, choice)
    tuned = tune_search(index, x, target=0.95, k=10, queries=1000)
    foot = footprint(index, choice)
    path = os.path.join(args.work, f"pq-{args.fraction}.faiss")
    faiss.write_index(index, path)
    del index
    np.save(path + ".queries.npy", x[qids])
    params = {"name": tuned.param_name, "value": tuned.param, "k_factor": tuned.k_factor}
    out = subprocess.run([sys.executable, __file__, "--serve", path, "--params", json.dumps(params)],
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    opened = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("SERVED "))[7:])
    recall = knn_recall(x, qids, np.load(path + ".ids.npy"), truth, 10)
    alone = knn_recall(x, qids, np.load(path + ".alone.npy"), truth, 10) if tuned.k_factor else None
    qps, added = opened["qps"], opened["anon_mib"]
    print("RESULT " + json.dumps({
        "fraction": args.fraction, "budget": budget,
        "variant": "no OPQ" if args.no_opq else "with OPQ" if args.with_opq else "rule",
        "factory": choice.factory, "n": n, "d": d,
        "nprobe": tuned.param, "k_factor": tuned.k_factor, "tuned_recall": tuned.recall, "met": tuned.met,
        "recall": round(recall, 4), "recall_codes_alone": None if alone is None else round(alone, 4),
        "qps": round(qps), "ram_bytes": foot["ram_bytes"], "disk_bytes": foot["disk_bytes"],
        "estimated_ram": choice.estimated_bytes, "served_anon_mib": round(added, 1),
        "file_bytes": os.path.getsize(path), "build_s": times.total_seconds, "train_s": times.train_seconds}))


def serve(path: str, params: dict) -> None:
    """Open the index as `imgest search` does, in a process of its own (so the memory it adds is its own), and
    search the saved queries: k+1 ids each (the query item is among them), once to warm the page cache."""
    from imgest.retrieval.params import refine_of, set_param
    from imgest.retrieval.versions import read_served

    queries = np.load(path + ".queries.npy")
    before = rss_anon_mib()
    index = read_served(path, "ivfpq", "disk" if params["k_factor"] else None)
    refine = refine_of(index)
    added = rss_anon_mib() - before
    set_param(index, params["name"], params["value"], params["k_factor"])
    index.search(queries, 11)
    t0 = time.perf_counter()
    _, ids = index.search(queries, 11)
    qps = len(queries) / (time.perf_counter() - t0)
    np.save(path + ".ids.npy", ids)
    if refine is not None:
        set_param(index, params["name"], params["value"], 1)
        np.save(path + ".alone.npy", index.search(queries, 11)[1])
    print("SERVED " + json.dumps({"qps": qps, "anon_mib": round(added, 1)}))


def autofaiss_at(args, fraction: int, work: str) -> dict:
    """autofaiss at the same RAM budget (its max_index_memory_usage), measured on the same held-out queries."""
    from bench_index import autofaiss_run

    from imgest.tasks.index.tuning import exact_neighbours, sample_queries

    x = vectors(args)
    n, d = x.shape
    budget = 4 * n * d // fraction
    qids = sample_queries(n, 1000, seed=1)
    truth, _ = exact_neighbours(x, qids, 10)
    folder = os.path.join(work, f"autofaiss-{fraction}")
    r = autofaiss_run(x, f"{budget // 1024}K", qids, truth, args.autofaiss_python, folder)
    return {"fraction": fraction, "budget": budget, "variant": "autofaiss", "factory": r["factory"], "n": n, "d": d,
            "nprobe": r["param"], "k_factor": None, "recall": r["recall@10"], "recall_codes_alone": None,
            "qps": round(r["qps"]) if r["qps"] == r["qps"] else 0, "ram_bytes": r["bytes"], "disk_bytes": 0,
            "estimated_ram": r["bytes"], "served_anon_mib": "-", "build_s": r["build_s"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--real-store")
    parser.add_argument("--fractions", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--fraction", type=int)
    parser.add_argument("--work")
    parser.add_argument("--no-opq", action="store_true")
    parser.add_argument("--with-opq", action="store_true",
                        help="beside each rule row without OPQ, the same index with an OPQ rotation in front "
                        "(over the budget by the d x d matrix: an ablation of what the rotation buys)")
    parser.add_argument("--autofaiss-python", help="the bench virtualenv's python (see bench/bench_index.py): "
                        "autofaiss at each budget too, its index measured by the same code")
    parser.add_argument("--serve")
    parser.add_argument("--params")
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve, json.loads(args.params))
    if args.fraction:
        return child(args)
    work = tempfile.mkdtemp(prefix="imgest-bench-pq-")
    rows = []

    def run(fraction: int, extra: list[str]) -> dict:
        command = [sys.executable, __file__, "--fraction", str(fraction), "--work", work, "--n", str(args.n),
                   "--d", str(args.d)] + (["--real-store", args.real_store] if args.real_store else []) + extra
        out = subprocess.run(command, capture_output=True, text=True)
        if out.returncode:
            print(out.stderr[-3000:])
            raise SystemExit(out.returncode)
        rows.append(json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:]))
        print(time.strftime("%H:%M:%S"), rows[-1], flush=True)
        return rows[-1]

    for fraction in args.fractions:
        if run(fraction, [])["factory"].startswith("OPQ"):  # where the rule chose OPQ: the same without it
            run(fraction, ["--no-opq"])
        elif args.with_opq:
            run(fraction, ["--with-opq"])
        if args.autofaiss_python:
            rows.append(autofaiss_at(args, fraction, work))
            print(time.strftime("%H:%M:%S"), rows[-1], flush=True)
    r0 = rows[0]
    print(f"\nN={r0['n']:,}, d={r0['d']}: fp32 {4 * r0['n'] * r0['d'] / 2**20:,.0f} MiB\n")
    print("| RAM budget | variant | factory | served | recall@10 | codes alone | QPS | RAM MiB (est.) | "
          "opened, anon MiB | disk MiB | build s |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| 1/{r['fraction']} ({r['budget'] / 2**20:,.0f} MiB) | {r['variant']} | `{r['factory']}` | "
              f"{served(r)} | {r['recall']} | {r['recall_codes_alone']} | "
              f"{r['qps']:,} | "
              f"{r['ram_bytes'] / 2**20:,.1f} ({r['estimated_ram'] / 2**20:,.1f}) | {r['served_anon_mib']} | "
              f"{r['disk_bytes'] / 2**20:,.0f} | {r['build_s']} |")


if __name__ == "__main__":
    main()
