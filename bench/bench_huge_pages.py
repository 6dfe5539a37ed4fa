"""Eager torch on a CPU with and without huge pages: the same encoder, the same photos, one process each way.

torch allocates a forward pass's activations afresh at every batch; without huge pages the kernel faults them in
4 KB at a time (imgest/memory.py). Each setting runs in a fresh process, because torch and glibc read theirs when
the process starts: `THP_MEM_ALLOC_ENABLE=0` (torch's switch off, as before imgest set it), imgest's default
(torch's tensors on huge pages), and that plus glibc's heap (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, as the
deployment image sets). The photos are the parity sample's product photos (imgest/images/demo.py), preprocessed once
per process; a warm-up batch first, then ROUNDS passes over them, timed.

    .venv/bin/python bench/bench_huge_pages.py --model efficientnet-lite0-gem --batch 32 --out huge_pages.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

SETTINGS = {
    "torch's switch off": {"THP_MEM_ALLOC_ENABLE": "0"},
    "imgest's default (torch)": {},
    "torch and glibc": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
}

CHILD = """
import json, resource, sys, time
import imgest, numpy as np, torch
from imgest import encoders
from imgest.encoders import parity
torch.set_num_threads(int(sys.argv[3]))
encoder = encoders.load(encoders.resolve(sys.argv[1]), "cpu")
batch, rounds = int(sys.argv[2]), int(sys.argv[4])
pixels = parity.sample_batch(encoder, slice(0, 4 * batch))
encoder.encode_images(pixels[:batch])
before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
for _ in range(rounds):
    for i in range(0, len(pixels), batch):
        encoder.encode_images(pixels[i:i + batch])
wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"images": rounds * len(pixels), "seconds": round(wall, 2),
                  "img_per_s": round(rounds * len(pixels) / wall, 2),
                  "user_s": round(after.ru_utime - before.ru_utime, 2),
                  "system_s": round(after.ru_stime - before.ru_stime, 2),
                  "page_faults": after.ru_minflt - before.ru_minflt}))
"""


def _cpu() -> str:
    with open("/proc/cpuinfo") as fh:
        names = [line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")]
    return f"{names[0]} x{len(names)}" if names else platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="efficientnet-lite0-gem")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    clean = {k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "GLIBC_TUNABLES")}
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
        thp = fh.read().strip()
    report = {"model": args.model, "batch": args.batch, "threads": args.threads, "runtime": "torch fp32 (eager)",
              "cpu": _cpu(), "transparent_hugepage": thp, "runs": {}}
    for name, env in SETTINGS.items():
        done = subprocess.run([sys.executable, "-c", CHILD, args.model, str(args.batch), str(args.threads),
                               str(args.rounds)], env={**clean, **env}, capture_output=True, text=True, check=True)
        report["runs"][name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(name, report["runs"][name], flush=True)
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
