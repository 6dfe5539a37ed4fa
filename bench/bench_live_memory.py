"""Heap used to load a model's live vectors and build its index: in memory against spilled to a scratch map.

    .venv/bin/python bench/bench_live_memory.py --store /tmp/imgest-bench/store-20000 --memory 40M

Each mode runs in a fresh process. Peak anonymous memory (RssAnon, sampled every 5 ms) is the heap the
load and the build took above the process's baseline; peak RSS also counts resident pages of the memory
map, which the kernel can drop and read back at will (page cache), so it is shown for reference only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def child(store_url: str, memory: str, spill: bool) -> dict:
    import imgest.state.live
    from imgest.state.models import find_model
    from imgest.storage import Location
    from imgest.tasks.index.build import build
    from imgest.tasks.index.choice import choose_index
    from imgest.tasks.index.tuning import tune_search

    if spill:
        imgest.state.live.SPILL_BYTES = 0
    store = Location(store_url)
    model = find_model(store, "efficientnet-lite0")
    base_anon = _status_kb("RssAnon")
    peak = {"anon": base_anon}
    stop = threading.Event()

    def sample():
        while not stop.wait(0.005):
            peak["anon"] = max(peak["anon"], _status_kb("RssAnon"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    live = imgest.state.live.load_live_vectors(store, model["slug"], model["dim"])
    loaded = time.perf_counter() - start
    choice = choose_index(len(live), live.vectors.shape[1], memory, "auto")
    index, _ = build(live.vectors, choice)
    tuned = tune_search(index, live.vectors, 0.95, 10, 1000)
    total = time.perf_counter() - start
    stop.set()
    sampler.join()
    return {"mode": "spilled" if spill else "in memory", "n": len(live), "d": int(live.vectors.shape[1]),
            "vectors_mb": round(live.vectors.nbytes / 2**20, 1), "factory": choice.factory,
            "recall@10": tuned.recall, "load_s": round(loaded, 2), "total_s": round(total, 2),
            "peak_heap_mb": round((peak["anon"] - base_anon) / 1024, 1),
            "peak_rss_mb": round(_status_kb("VmHWM") / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", required=True)
    parser.add_argument("--memory", default="40M")
    parser.add_argument("--child", choices=["memory", "spill"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.store, args.memory, args.child == "spill")))
        return
    rows = []
    for mode in ("memory", "spill"):
        out = subprocess.run([sys.executable, __file__, "--store", args.store, "--memory", args.memory,
                              "--child", mode], check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")
    print(f"\nheap ratio spilled / in memory: {rows[1]['peak_heap_mb'] / rows[0]['peak_heap_mb']:.2f} "
          f"(vectors {rows[0]['vectors_mb']} MB)")


if __name__ == "__main__":
    main()
