"""The readers of the catalogue metadata on a store at catalogue size: `imgest export`, `imgest sync` to LanceDB
and the search service (`imgest api`: warm-up, then searches by item id, filtered, grouped), each a process of
its own, as a user runs them: wall seconds and peak RSS (the kernel's high-water mark, VmHWM; the service's also
after warm-up and after the load).

    OPENBLAS_CORETYPE=Haswell .venv/bin/python bench/bench_nightly_scale.py --objects 1000000 --metadata \\
        --workdir /tmp/imgest-scale-1m
    OPENBLAS_CORETYPE=Haswell .venv/bin/python bench/bench_metadata_readers.py \\
        --store /tmp/imgest-scale-1m/night/store --json

Queries by item id are items of the served version (its stored vector is the query, so the figures are the
service's and the index's, not a model's), sampled with a fixed seed; a filtered query is the same with
`--where` over the bench catalogue's columns (a category and a price range: about 1 in 40 items), a grouped
one with `--group-by product_id`. Sequential requests on one kept-alive connection: p50 and p99 per kind. Then
the same items under load: `--clients` connections at once, each sending the three kinds in turn as fast as the
answers come (throughput, p50/p99 per kind). The store is copied first (hard links: imgest writes new files,
never into old ones), so the sync's watermarks stay out of it. The index cache is empty (HOME is a new folder),
so the service's warm-up includes making the version's metadata file.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMGEST = os.path.join(os.path.dirname(sys.executable), "imgest")


def timed(command: list[str], env: dict) -> dict:
    """Run an imgest command under /usr/bin/time -v: its seconds and peak RSS in MB."""
    started = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-v", *command], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1)) / 1024
    return {"seconds": round(seconds, 1), "peak_mb": round(peak)}


def status_mb(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(conn: http.client.HTTPConnection, body: dict) -> tuple[float, dict]:
    started = time.perf_counter()
    conn.request("POST", "/search", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    took = (time.perf_counter() - started) * 1000
    if response.status != 200:
        raise SystemExit(f"/search {body}: {response.status} {data[:500]!r}")
    return took, json.loads(data)


def served_items(store: str, n: int, seed: int = 0) -> list[str]:
    """n item ids of the serving version, from its id map."""
    import pyarrow.parquet as pq

    sys.path.insert(0, ROOT)
    from imgest.retrieval.versions import ids_file, read_card, resolve_target
    from imgest.storage import Location

    location = Location(store)
    slug, version = resolve_target(location, "serving", None, None)
    path = ids_file(location, read_card(location, slug, version), tempfile.mkdtemp(prefix="bench-ids-"))
    file = pq.ParquetFile(path)
    rows = np.sort(np.random.default_rng(seed).choice(file.metadata.num_rows, n, replace=False))
    ids = file.read(columns=["item_id"]).column("item_id")
    return [ids[int(r)].as_py() for r in rows]


def under_load(port: int, items: list[str], kinds: dict, clients: int) -> dict:
    """`clients` threads, each on its own kept-alive connection, sending the three kinds in turn (by item id,
    filtered, grouped) over the same items as fast as answers come: throughput and p50/p99 per kind."""
    import threading

    taken: dict[str, list[float]] = {kind: [] for kind in kinds}
    names = list(kinds)
    lock = threading.Lock()

    def client(number: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        for at in range(number, len(items), clients):
            kind = names[at % len(names)]
            took, _ = request(conn, {"item_id": items[at], "k": 10, **kinds[kind]})
            with lock:
                taken[kind].append(took)
        conn.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    out = {"clients": clients, "queries": len(items), "seconds": round(seconds, 1),
           "per_second": round(len(items) / seconds, 1)}
    for kind, ms in taken.items():
        out[kind] = {"p50_ms": round(float(np.percentile(ms, 50)), 2), "p99_ms": round(float(np.percentile(ms, 99)), 2),
                     "queries": len(ms)}
    return out


def service(store: str, env: dict, queries: int, clients: int = 0) -> dict:
    port = free_port()
    log = open(os.path.join(env["HOME"], "api.log"), "w")
    started = time.perf_counter()
    proc = subprocess.Popen([IMGEST, "api", "--store", store, "--port", str(port)], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"imgest api exited: {open(log.name).read()[-3000:]}")
            try:
                conn.request("GET", "/healthz")
                response = conn.getresponse()
                response.read()
                if response.status == 200:
                    break
            except OSError:
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            time.sleep(0.2)
        out = {"warm_seconds": round(time.perf_counter() - started, 1),
               "warm_rss_mb": round(status_mb(proc.pid, "VmRSS")), "warm_peak_mb": round(status_mb(proc.pid, "VmHWM")),
               "warm_anon_mb": round(status_mb(proc.pid, "RssAnon")),
               "warm_file_mb": round(status_mb(proc.pid, "RssFile"))}
        conn.request("GET", "/columns")
        columns = json.loads(conn.getresponse().read())
        out["columns"] = len(columns if isinstance(columns, list) else columns.get("columns", []))
        items = served_items(store, queries)
        kinds = {"by_item_id": {}, "filtered": {"where": "category = 'boot' AND price < 250"},
                 "grouped": {"group_by": "product_id"}}
        for kind, extra in kinds.items():
            first, _ = request(conn, {"item_id": items[0], "k": 10, **extra})  # a predicate's first use evaluates it
            ms, hits = [], 0
            for item in items:
                took, answer = request(conn, {"item_id": item, "k": 10, **extra})
                ms.append(took)
                hits += len(answer.get("hits", answer.get("results", [])))
            out[kind] = {"first_ms": round(first, 2), "p50_ms": round(float(np.percentile(ms, 50)), 2),
                         "p99_ms": round(float(np.percentile(ms, 99)), 2), "queries": len(ms), "hits": hits,
                         "rss_mb": round(status_mb(proc.pid, "VmRSS")),
                         "anon_mb": round(status_mb(proc.pid, "RssAnon")),
                         "file_mb": round(status_mb(proc.pid, "RssFile"))}
        if clients:
            out["under_load"] = under_load(port, items, kinds, clients)
            out["under_load"].update(rss_mb=round(status_mb(proc.pid, "VmRSS")),
                                     anon_mb=round(status_mb(proc.pid, "RssAnon")),
                                     file_mb=round(status_mb(proc.pid, "RssFile")))
        out["rss_after_mb"] = round(status_mb(proc.pid, "VmRSS"))
        out["peak_mb"] = round(status_mb(proc.pid, "VmHWM"))
        return out
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", required=True, help="a store with metadata and a serving index (local folder)")
    parser.add_argument("--queries", type=int, default=300, help="requests per kind")
    parser.add_argument("--clients", type=int, default=8,
                        help="then the three kinds mixed from this many concurrent connections (0: none)")
    parser.add_argument("--skip", nargs="*", default=[], choices=("export", "sync", "service"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="bench-metadata-readers-")
    env = {**os.environ, "HOME": work, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}  # an empty index cache
    result: dict = {"store": args.store}
    store = os.path.join(work, "store")
    subprocess.run(["cp", "-al", args.store, store], check=True)
    try:
        if "export" not in args.skip:
            result["export"] = timed([IMGEST, "export", "--store", store, "--out",
                                      os.path.join(work, "export.parquet")], env)
            print("export", result["export"], flush=True)
        if "sync" not in args.skip:
            result["sync"] = timed([IMGEST, "sync", "--store", store, "--to",
                                    f"lancedb://{os.path.join(work, 'lance')}/items"], env)
            print("sync", result["sync"], flush=True)
        if "service" not in args.skip:
            result["service"] = service(store, env, args.queries, args.clients)
            print("service", result["service"], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
