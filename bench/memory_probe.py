"""Where an imgest command's memory is, over time: the command runs in this process (on the bench's own Prefect
server) with a sampler thread writing, every 0.5 s, one JSON line of its RSS (anonymous and file-backed), glibc's
allocator (`mallinfo2`: in use, free in its arenas, mmapped chunks) and Arrow's pool. What is anonymous but in
neither allocator is DuckDB's (jemalloc), Python's own arenas and thread stacks; file-backed pages are libraries and
memory-mapped files. Read it beside the command's log (its task start and finish times).

    OPENBLAS_CORETYPE=Haswell .venv/bin/python bench/memory_probe.py --out /tmp/probe -- \\
        build-index --store STORE --model raw-pixels-4 --memory 1G --kind ivfsq8 --target-recall 0.5 --rebuild

writes /tmp/probe/memory.jsonl and /tmp/probe/command.log. The sampler shares the GIL: during a long call that
holds it (faiss's k-means through SWIG) its samples pause, so a peak inside such a call is seen as the process's
high-water mark (`VmHWM`), not in time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = "IMGEST_MEMORY_PROBE_OUT"


def sample() -> dict:
    """One sample of this process, in MiB."""
    from tests.helpers import mallinfo

    info = mallinfo()
    out: dict = {"t": round(time.time(), 2), "malloc_used": (info.uordblks + info.hblkhd) >> 20,
                 "malloc_free": info.fordblks >> 20, "malloc_mmapped": info.hblkhd >> 20}
    with open("/proc/self/status") as fh:
        for line in fh:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) >> 10
    arrow = sys.modules.get("pyarrow")
    if arrow is not None and hasattr(arrow, "total_allocated_bytes"):  # not while it is still importing
        out["arrow"] = arrow.total_allocated_bytes() >> 20
    return out


def sampler(path: str, every: float = 0.5) -> None:
    with open(path, "w") as fh:
        while True:
            fh.write(json.dumps(sample()) + "\n")
            fh.flush()
            time.sleep(every)


def child(args: list[str]) -> None:
    """The command, in this process, under the sampler."""
    sys.path.insert(0, ROOT)
    threading.Thread(target=sampler, args=(os.environ[CHILD],), daemon=True).start()
    sys.argv = ["imgest", *args]
    from imgest.cli import app

    app()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for memory.jsonl, command.log and the Prefect server")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the imgest command's arguments")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    os.makedirs(args.out, exist_ok=True)
    sys.path.insert(0, ROOT)
    from bench.bench_nightly_scale import PrefectServer

    with PrefectServer(os.path.join(args.out, "prefect")) as server:
        env = {**os.environ, **server.env, CHILD: os.path.join(args.out, "memory.jsonl"),
               "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE", "Haswell")}
        start = time.time()
        with open(os.path.join(args.out, "command.log"), "w") as log:
            rc = subprocess.call([sys.executable, __file__, "--child", *command], env=env, stdout=log,
                                 stderr=subprocess.STDOUT)
    print(json.dumps({"rc": rc, "seconds": round(time.time() - start, 1), "samples": os.path.join(args.out,
                                                                                                  "memory.jsonl")}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2:])
    else:
        main()
