"""Index benchmark: per kind, build time, QPS and recall@10 against exact at the served parameters,
on clustered synthetic vectors and on real Lite0 embeddings, beside autofaiss at the same memory.

    .venv/bin/python bench/bench_index.py --n 1000000 --d 512 --memory 1G \
        --real-store /tmp/imgest-bench/store-big --real-memory 40M

autofaiss runs in its own virtualenv (it pins numpy < 2, so pyarrow < 20 there; autofaiss 2.18 calls
faiss.OPQMatrix(M=...), which faiss 1.15 no longer accepts, so that environment keeps faiss 1.7.4):
    python3 -m venv .venv-bench && .venv-bench/bin/pip install autofaiss "pyarrow<20" "faiss-cpu==1.7.4"
Its index is then loaded here, with the search parameters it chose, and measured by the same code.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from imgest.names import parse_memory  # noqa: E402
from imgest.tasks.index.build import build  # noqa: E402
from imgest.tasks.index.choice import choose_index  # noqa: E402
from imgest.tasks.index.tuning import exact_neighbours, knn_recall, sample_queries, tune_search  # noqa: E402


def clustered(n: int, d: int, clusters: int = 2000, noise: float = 0.6, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, d), dtype=np.float32)
    out = np.empty((n, d), np.float32)
    for start in range(0, n, 100_000):
        stop = min(n, start + 100_000)
        out[start:stop] = centres[rng.integers(0, clusters, stop - start)]
        out[start:stop] += noise * rng.standard_normal((stop - start, d), dtype=np.float32)
    out /= np.linalg.norm(out, axis=1, keepdims=True)
    return out


def measure(index, x: np.ndarray, qids: np.ndarray, truth: np.ndarray, k: int = 10) -> tuple[float, float]:
    t0 = time.perf_counter()
    _, ids = index.search(x[qids], k + 1)
    qps = len(qids) / (time.perf_counter() - t0)
    return knn_recall(x, qids, ids, truth, k), qps


def ours(x, kind, memory, qids, truth, queries) -> dict:
    import faiss

    choice = choose_index(len(x), x.shape[1], memory, kind)
    index, times = build(x, choice)
    t0 = time.perf_counter()
    tuned = tune_search(index, x, target=0.95, k=10, queries=queries)
    tune_s = time.perf_counter() - t0
    recall, qps = measure(index, x, qids, truth)
    size = len(faiss.serialize_index(index))
    return {"who": "imgest", "factory": choice.factory, "build_s": times.total_seconds, "tune_s": round(tune_s, 1),
            "param": f"{tuned.param_name}={tuned.param}" if tuned.param_name else "exact",
            "recall@10": round(recall, 4), "qps": round(qps, 1), "bytes": size}


def autofaiss_run(x, memory, qids, truth, python, work) -> dict:
    import faiss

    emb = os.path.join(work, "emb")
    os.makedirs(emb, exist_ok=True)
    np.save(os.path.join(emb, "part-0.npy"), x)
    out = subprocess.run([python, os.path.join(ROOT, "bench", "autofaiss_child.py"), emb, work, memory],
                         capture_output=True, text=True)
    if out.returncode != 0:
        reason = (out.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"autofaiss failed: {reason}", flush=True)
        return {"who": "autofaiss (failed)", "factory": reason[:60], "build_s": float("nan"), "tune_s": 0.0,
                "param": "", "recall@10": float("nan"), "qps": float("nan"), "bytes": 0}
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    index = faiss.read_index(os.path.join(work, "autofaiss.index"))
    params = result["infos"].get("index_param", "")
    if params:
        faiss.ParameterSpace().set_index_parameters(index, params)
    recall, qps = measure(index, x, qids, truth)
    return {"who": "autofaiss", "factory": result["infos"].get("index_key"), "build_s": result["seconds"],
            "tune_s": 0.0, "param": params, "recall@10": round(recall, 4), "qps": round(qps, 1),
            "bytes": os.path.getsize(os.path.join(work, "autofaiss.index"))}


def autofaiss_versions(python: str) -> str:
    out = subprocess.run([python, "-c", "import autofaiss, faiss; from importlib.metadata import version; "
                          "print('autofaiss', version('autofaiss'), 'faiss', faiss.__version__)"],
                         capture_output=True, text=True)
    return out.stdout.strip() or out.stderr.strip()[-200:]


def table(title: str, rows: list[dict]) -> None:
    print(f"\n## {title}\n")
    print("| who | factory | served | build s | recall@10 | QPS | MiB |\n|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['who']} | `{r['factory']}` | {r['param']} | {r['build_s']} | {r['recall@10']} | {r['qps']} | "
              f"{r['bytes'] / 2**20:.1f} |")


def suite(name: str, x: np.ndarray, memory: str, kinds: list[str], args, work: str) -> None:
    qids = sample_queries(len(x), args.queries, seed=1)
    t0 = time.perf_counter()
    truth, _ = exact_neighbours(x, qids, 10)
    print(f"\n{name}: N={len(x)}, d={x.shape[1]}, budget {memory} ({parse_memory(memory)} bytes); exact top-10 for "
          f"{len(qids)} queries in {time.perf_counter() - t0:.1f} s")
    rows = []
    auto = choose_index(len(x), x.shape[1], memory)
    for kind in kinds:
        rows.append(ours(x, kind, "1T", qids, truth, args.queries))
        if choose_index(len(x), x.shape[1], "1T", kind).factory == auto.factory:
            rows[-1]["who"] = f"imgest (auto at {memory})"
        print(time.strftime("%H:%M:%S"), rows[-1], flush=True)
    if not any(r["factory"] == auto.factory for r in rows):
        rows.append(ours(x, "auto", memory, qids, truth, args.queries) | {"who": f"imgest (auto at {memory})"})
    if args.autofaiss_python and os.path.exists(args.autofaiss_python):
        print(time.strftime("%H:%M:%S"), "autofaiss starts", flush=True)
        rows.append(autofaiss_run(x, memory, qids, truth, args.autofaiss_python,
                                  os.path.join(work, name.replace(" ", "-"))))
        print(time.strftime("%H:%M:%S"), rows[-1], flush=True)
    table(f"{name} (budget {memory})", rows)
    ours_auto = next(r for r in rows if r["who"].startswith("imgest (auto"))
    theirs = next((r for r in rows if r["who"] == "autofaiss"), None)
    print(f"autofaiss environment: {autofaiss_versions(args.autofaiss_python)}")
    if theirs:
        print(f"\nimgest auto / autofaiss at {memory}: recall {ours_auto['recall@10']} / {theirs['recall@10']} = "
              f"{ours_auto['recall@10'] / theirs['recall@10']:.3f} (goal >= 1); build time {ours_auto['build_s']} / "
              f"{theirs['build_s']} = {ours_auto['build_s'] / theirs['build_s']:.2f} (goal <= 1)")


def faiss_gflops() -> float:
    import faiss

    x, q = np.random.rand(50_000, 512).astype(np.float32), np.random.rand(1000, 512).astype(np.float32)
    index = faiss.IndexFlatIP(512)
    index.add(x)
    t0 = time.perf_counter()
    index.search(q, 10)
    return 2 * 1000 * 50_000 * 512 / (time.perf_counter() - t0) / 1e9


def numpy_gflops() -> float:
    x, q = np.random.rand(50_000, 512).astype(np.float32), np.random.rand(1000, 512).astype(np.float32)
    t0 = time.perf_counter()
    q @ x.T
    return 2 * 1000 * 50_000 * 512 / (time.perf_counter() - t0) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--memory", default="1G")
    parser.add_argument("--kinds", default="hnsw,ivfsq8,ivfpq")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--real-store", default=None)
    parser.add_argument("--real-memory", default="40M")
    parser.add_argument("--autofaiss-python", default=os.path.join(ROOT, ".venv-bench", "bin", "python"))
    parser.add_argument("--skip-synthetic", action="store_true")
    args = parser.parse_args()

    import faiss
    from threadpoolctl import threadpool_info

    work = tempfile.mkdtemp(prefix="imgest-index-bench-")
    print(f"sgemm GFLOP/s: faiss {faiss_gflops():.1f}, numpy {numpy_gflops():.1f} "
          f"(OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset')})")
    print(f"# imgest index benchmark ({time.strftime('%Y-%m-%d')}), faiss {faiss.__version__}, "
          f"{os.cpu_count()} cores, blas: " + ", ".join(f"{i['internal_api']} {i.get('architecture')}"
                                                       for i in threadpool_info()))
    kinds = args.kinds.split(",")
    if args.real_store:
        from imgest.state.live import load_live_vectors
        from imgest.state.models import find_model
        from imgest.storage import Location

        store = Location(args.real_store)
        card = find_model(store, "efficientnet-lite0")
        live = load_live_vectors(store, card["slug"], card["dim"])
        real_kinds = list(dict.fromkeys(["flat", *kinds]))
        suite("real Lite0 embeddings", live.vectors, args.real_memory, real_kinds, args, work)
    if not args.skip_synthetic:
        suite("clustered synthetic", clustered(args.n, args.d), args.memory, kinds, args, work)


if __name__ == "__main__":
    main()
