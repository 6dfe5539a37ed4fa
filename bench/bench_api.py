"""The search service beside in-process search, and under steady load through nightly, promote, rollback, promote.

    OPENBLAS_CORETYPE=Haswell .venv/bin/python bench/bench_api.py [--n 100000] [--rate 20] [--phase-s 15]

A store is written directly: `--n` items as clustered vectors under two real models' cards (raw-pixels, 768-d,
serving; efficientnet-lite0, 1280-d, the migration candidate), the same item ids and content under both, in
shards of ingest's default size, and their indexes built by build-index at its defaults. Queries are by item
id (the item's stored vector), so the figures are the service's and the index's, not an image model's.

1. Overhead: the same 500 queries (k=10), sequential, answered in-process by a FollowingSearcher (with each hit's
   metadata, as the service does) and through `imgest api` on loopback (HTTP, JSON, the thread pool): p50, p99,
   queries per second. The difference at p50 with the standard library's client on one kept-alive connection
   is what the service adds; the same through httpx shows what a heavier client adds on top.
2. Swaps under load: `imgest api --follow-every 1` (a subprocess) gets queries from 4 client threads, each
   sending one every 4/rate seconds (a late answer delays only its own client), while a nightly rebuild moves
   serving to v2 of the old model, then promote (forced: the bench has no labelled set), rollback and promote
   again move it between the models. Per phase: requests, failed ones (any non-200 or connection error),
   latency p50/p99; the service's resident memory high-water (psutil, every 0.1 s). "during" runs from the
   alias move to the moment /aliases shows the new version. Everything shares this machine's cores, the nightly
   build included.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.bench_index import clustered  # noqa: E402
from bench.bench_index_update import seed_store  # noqa: E402


def percentiles(ms: list[float]) -> str:
    if not ms:
        return "-"
    return f"{np.percentile(ms, 50):7.2f} {np.percentile(ms, 99):8.2f}"


def build_store(path: str, n: int) -> tuple[dict, dict]:
    from imgest import encoders
    from imgest.config import IndexConfig
    from imgest.flows.build_index import build_index
    from imgest.names import DEFAULT_SHARD_SIZE
    from imgest.storage import Location
    from imgest.tasks.migration.window import open_window

    store = Location(path)
    old, new = encoders.resolve("raw-pixels").describe(), encoders.resolve("efficientnet-lite0").describe()
    t0 = time.perf_counter()
    for seed, model in enumerate((old, new)):
        seed_store(store, clustered(n, model["dim"], seed=seed), shard_rows=DEFAULT_SHARD_SIZE, model=model)
    print(f"seeded {n:,} items under {old['slug']} and {new['slug']} in {time.perf_counter() - t0:.0f} s", flush=True)
    t0 = time.perf_counter()
    serving = build_index(IndexConfig(store=path, model=old["slug"], alias="serving"))["card"]
    open_window(store, old["slug"], new, catalogue=None)
    shadow = build_index(IndexConfig(store=path, model=new["slug"], alias="shadow"))["card"]
    print(f"indexes: serving {serving['factory']} ({old['slug']} v1), shadow {shadow['factory']} ({new['slug']} "
          f"v1), built in {time.perf_counter() - t0:.0f} s", flush=True)
    return old, new


class Service:
    def __init__(self, store: str):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self.proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "imgest"), "api", "--store", store,
                                      "--port", str(self.port), "--follow-every", "1", "--device", "cpu"])
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the service did not become ready")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def overhead(store: str, service: Service, ids: list[str]) -> None:
    import http.client
    import json

    import httpx

    from imgest.retrieval.following import FollowingSearcher
    from imgest.retrieval.query import Query

    follower = FollowingSearcher(store, device="cpu")
    follower.refresh()
    plain = http.client.HTTPConnection("127.0.0.1", service.port, timeout=60)  # one kept-alive connection
    client = httpx.Client(base_url=service.url, timeout=60)

    def post(item: str) -> None:
        plain.request("POST", "/search", json.dumps({"item_id": item, "k": 10}), {"content-type": "application/json"})
        answer = plain.getresponse()
        assert answer.status == 200 and json.loads(answer.read())["hits"]

    def post_httpx(item: str) -> None:
        assert client.post("/search", json={"item_id": item, "k": 10}).status_code == 200

    rows = {}
    for label, ask in (
            ("in-process (FollowingSearcher)",
             lambda item: follower.search([Query("q", item_id=item)], 10, with_metadata=True)),
            ("imgest api, stdlib http.client", post),
            ("imgest api, httpx client", post_httpx)):
        for item in ids:  # warm: the stored vectors are read once, then cached, on each side
            ask(item)
        took = []
        started = time.perf_counter()
        for item in ids:
            t0 = time.perf_counter()
            ask(item)
            took.append(1000 * (time.perf_counter() - t0))
        rows[label] = (took, len(ids) / (time.perf_counter() - started))
    client.close()
    print(f"\n## Service overhead: {len(ids)} item-id queries, k=10, sequential\n")
    print(f"{'':34s} {'p50 ms':>7s} {'p99 ms':>8s} {'queries/s':>10s}")
    for label, (took, qps) in rows.items():
        print(f"{label:34s} {percentiles(took)} {qps:10.1f}")
    (inproc, _), (served, _), _ = rows.values()
    print(f"service adds {np.percentile(served, 50) - np.percentile(inproc, 50):.2f} ms at p50, "
          f"{np.percentile(served, 99) - np.percentile(inproc, 99):.2f} ms at p99 (stdlib client)", flush=True)


class Load:
    """Client threads at a steady rate; each request's start time, latency and outcome."""

    def __init__(self, url: str, ids: list[str], rate: float, clients: int = 4):
        self.url, self.ids, self.every, self.clients = url, ids, clients / rate, clients
        self.results: list[tuple[float, float, bool]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.client, args=(c,), daemon=True) for c in range(clients)]

    def client(self, number: int) -> None:
        import httpx

        rng = np.random.default_rng(number)
        with httpx.Client(base_url=self.url, timeout=30) as http:
            due = time.monotonic() + number * self.every / self.clients
            while not self.stop.is_set():
                time.sleep(max(0.0, due - time.monotonic()))
                due += self.every
                t0 = time.monotonic()
                try:
                    ok = http.post("/search", json={"item_id": self.ids[rng.integers(len(self.ids))],
                                                    "k": 10}).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.results.append((t0, 1000 * (time.monotonic() - t0), ok))

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()


class Memory:
    def __init__(self, pid: int):
        import psutil

        self.process, self.samples = psutil.Process(pid), []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.wait(0.1):
            self.samples.append((time.monotonic(), self.process.memory_info().rss))

    def high(self, start: float, end: float) -> float:
        inside = [rss for t, rss in self.samples if start <= t < end]
        return max(inside) / 2**20 if inside else float("nan")


def served_version(url: str) -> tuple[str, int]:
    import httpx

    status = httpx.get(f"{url}/aliases", timeout=10).json()["serving"]
    return status["model"], status["version"]


def swaps(store_path: str, service: Service, ids: list[str], rate: float, phase_s: float, old: dict, n: int) -> None:
    from imgest.config import IndexConfig
    from imgest.flows.build_index import build_index
    from imgest.storage import Location
    from imgest.tasks.migration.window import promote, rollback

    store = Location(store_path)
    memory, load = Memory(service.proc.pid), Load(service.url, ids, rate)
    memory.thread.start()
    load.start()
    marks = [(time.monotonic(), "before")]
    time.sleep(phase_s)
    steps = (("nightly", lambda: build_index(IndexConfig(store=store_path, model=old["slug"], alias="serving",
                                                         rebuild=True))),
             ("promote", lambda: promote(store, force="bench: no labelled set")),
             ("rollback", lambda: rollback(store)),
             ("promote again", lambda: promote(store, force="bench: no labelled set")))
    for name, step in steps:
        was = served_version(service.url)
        marks.append((time.monotonic(), f"during {name}"))
        step()
        while served_version(service.url) == was:
            time.sleep(0.05)
        now = served_version(service.url)
        marks.append((time.monotonic(), f"after {name} ({now[0].split('-')[0]} v{now[1]})"))
        time.sleep(phase_s)
    marks.append((time.monotonic(), "end"))
    load.finish()
    memory.stop.set()
    print(f"\n## Swaps under load: {n:,}-item store, {rate:g} requests/s from 4 clients, item-id queries, "
          "k=10\n")
    print(f"{'phase':40s} {'seconds':>7s} {'requests':>8s} {'failed':>6s} {'p50 ms':>7s} {'p99 ms':>8s} "
          f"{'RSS high MiB':>12s}")
    for (start, name), (end, _) in zip(marks, marks[1:]):
        inside = [(ms, ok) for t, ms, ok in load.results if start <= t < end]
        print(f"{name:40s} {end - start:7.1f} {len(inside):8d} {sum(not ok for _, ok in inside):6d} "
              f"{percentiles([ms for ms, _ in inside])} {memory.high(start, end):12.0f}")
    failed = sum(not ok for _, _, ok in load.results)
    print(f"total: {len(load.results)} requests, {failed} failed", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--phase-s", type=float, default=15.0)
    parser.add_argument("--queries", type=int, default=500)
    parser.add_argument("--only", choices=("overhead", "swaps"), help="run one of the two parts")
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    work = tempfile.mkdtemp(prefix="imgest-bench-api-")
    store = os.path.join(work, "store")
    old, _ = build_store(store, args.n)
    ids = [f"item/{i:08d}" for i in np.random.default_rng(1).choice(args.n, args.queries, replace=False)]
    service = Service(store)
    try:
        service.wait_ready()
        if args.only != "swaps":
            overhead(store, service, ids)
        if args.only != "overhead":
            swaps(store, service, ids, args.rate, args.phase_s, old, args.n)
    finally:
        service.stop()


if __name__ == "__main__":
    main()
