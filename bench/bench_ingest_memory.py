"""Peak memory of `imgest ingest` against catalogue size: it should stay flat.

    .venv/bin/python bench/bench_ingest_memory.py [--sizes 150,600] [--shard-size 100]

For each size, a product catalogue of that many photos (`imgest.images.demo.product_photos`: 800-2000 px JPEGs,
some progressive or sideways, PNG cut-outs) is written to a folder and ingested with the command line
(`imgest ingest --model efficientnet-lite0`, a Prefect run on an ephemeral server) into a fresh store.
Reported per size: the command's peak RSS (the kernel's ru_maxrss for that process: the flow, its tasks,
the decode threads and the model; the Prefect server is another process, not counted), the peak of that
process plus its decode processes together (sampled every 0.1 s from /proc), wall seconds and images/s.
Flat means the peak does not grow with the catalogue: decode-ahead is bounded, shards are
written one at a time, and the state is a table of rows, not of images.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next((int(line.split()[1]) for line in fh if line.startswith("VmRSS:")), 0)
    except OSError:
        return 0


def _decode_children(pid: int) -> list[int]:
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                for child in fh.read().split():
                    with open(f"/proc/{child}/cmdline", "rb") as cmd:
                        if b"spawn_main" in cmd.read():
                            found.append(int(child))
    except OSError:
        pass
    return found


def watch_tree(pid: int, peak: list[int], done: threading.Event) -> None:
    """Peak RSS of the process plus its decode processes, sampled."""
    while not done.is_set():
        peak[0] = max(peak[0], _rss_kb(pid) + sum(_rss_kb(c) for c in _decode_children(pid)))
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="150,600")
    parser.add_argument("--shard-size", type=int, default=100)
    args = parser.parse_args()

    from imgest.images.demo import product_photos
    from imgest.storage import Location

    imgest = os.path.join(os.path.dirname(sys.executable), "imgest")
    sizes = [int(s) for s in args.sizes.split(",")]
    files = product_photos(max(sizes))
    print(f"catalogue up to {max(sizes)} objects, {sum(map(len, files.values())) / 1e6:.0f} MB")
    with tempfile.TemporaryDirectory() as root:
        env = {**os.environ, "PREFECT_HOME": os.path.join(root, "prefect-home"),
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        env.pop("PREFECT_API_URL", None)
        for n in sizes:
            cat = Location(os.path.join(root, f"cat-{n}"))
            for key in list(files)[:n]:
                cat.write_bytes(key, files[key])
            log = os.path.join(root, f"ingest-{n}.log")
            start = time.perf_counter()
            with open(log, "wb") as out:
                proc = subprocess.Popen([imgest, "ingest", "--catalogue", cat.url, "--store",
                                         os.path.join(root, f"store-{n}"), "--model", "efficientnet-lite0",
                                         "--shard-size", str(args.shard_size)],
                                        stdout=out, stderr=subprocess.STDOUT, env=env)
                peak, done = [0], threading.Event()
                watcher = threading.Thread(target=watch_tree, args=(proc.pid, peak, done), daemon=True)
                watcher.start()
                _, status, usage = os.wait4(proc.pid, 0)
                done.set()
                watcher.join()
            seconds = time.perf_counter() - start
            if status != 0:
                with open(log) as fh:
                    sys.exit(f"ingest of {n} failed: {fh.read()[-2000:]}")
            print(f"{n:6d} objects: peak RSS {usage.ru_maxrss / 1024:7.0f} MiB (with decode processes "
                  f"{peak[0] / 1024:.0f} MiB), {seconds:6.1f} s wall (Prefect start included), "
                  f"{n / seconds:5.1f} objects/s")


if __name__ == "__main__":
    main()
