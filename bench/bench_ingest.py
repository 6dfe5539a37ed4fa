"""Ingest benchmark: bare-model img/s by batch, pipeline vs bare, no-op nightly, peak RSS at two sizes.

    .venv/bin/python bench/bench_ingest.py --images 20000 --small 5000

Each ingest runs in its own process (for its peak RSS) against one Prefect server started here.
Figures are printed as ratios measured in this one run; paste the output into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CHILD = """
import json, resource, sys, time
from imgest.flows.ingest import ingest
from imgest import encoders
from imgest.tasks.ingest.batch_size import measure
t0 = time.perf_counter()
summary = ingest(config=dict(catalogue=sys.argv[1], store=sys.argv[2], batch_size=sys.argv[3], device=sys.argv[4]))
summary["wall_seconds"] = round(time.perf_counter() - t0, 2)
summary["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
if summary["encoded"]:
    # the bare model in the same process, right after, at the same batch size: the fair comparison
    encoder = encoders.load(encoders.resolve("efficientnet-lite0"), sys.argv[4])
    summary["bare_images_per_second"] = round(measure(encoder, int(sys.argv[3]), min_seconds=20.0), 2)
print("RESULT " + json.dumps(summary))
"""


def write_catalogue(root: str, n: int) -> None:
    from PIL import Image

    from imgest.images.demo import FASHION_CLASSES, read_fashion_mnist

    images, labels = read_fashion_mnist("train")
    for i in range(n):
        folder = os.path.join(root, FASHION_CLASSES[labels[i]])
        os.makedirs(folder, exist_ok=True)
        Image.fromarray(images[i]).save(os.path.join(folder, f"{i:06d}.png"))


def child_ingest(catalogue: str, store: str, batch: str, device: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, catalogue, store, batch, device], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=True)
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=20000)
    parser.add_argument("--small", type=int, default=5000)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()

    import torch
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness
    from threadpoolctl import threadpool_info

    from imgest import encoders
    from imgest.tasks.ingest.batch_size import tune_batch_size

    work = args.workdir or tempfile.mkdtemp(prefix="imgest-bench-")
    print(f"# imgest ingest benchmark ({time.strftime('%Y-%m-%d')})")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads, cuda={torch.cuda.is_available()}")
    print("blas: " + ", ".join(f"{i['internal_api']} {i.get('architecture')}" for i in threadpool_info()))

    spec = encoders.resolve("efficientnet-lite0")
    encoder = encoders.load(spec, args.device)
    tuning = tune_batch_size(encoder, min_seconds=2.0)
    base = tuning.measured[1]
    print(f"\n## Bare model ({spec.model_id}) on {encoder.device}, synthetic 224x224 input")
    print("| batch | img/s | vs batch 1 |\n|---:|---:|---:|")
    for size, rate in sorted(tuning.measured.items()):
        print(f"| {size} | {rate:.1f} | {rate / base:.2f} |")
    print(f"auto picks batch {tuning.batch_size} ({tuning.stopped}); "
          f"{tuning.measured[tuning.batch_size] / base:.2f}x batch 1")

    small_cat, big_cat = os.path.join(work, f"cat-{args.small}"), os.path.join(work, f"cat-{args.images}")
    for folder, n in ((small_cat, args.small), (big_cat, args.images)):
        if not os.path.exists(folder):
            write_catalogue(folder, n)
    batch = str(tuning.batch_size)
    with prefect_test_harness(server_startup_timeout=90):
        env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": ROOT}
        small = child_ingest(small_cat, os.path.join(work, f"store-{args.small}"), batch, args.device, env)
        full = child_ingest(big_cat, os.path.join(work, f"store-{args.images}"), batch, args.device, env)
        noop = child_ingest(big_cat, os.path.join(work, f"store-{args.images}"), batch, args.device, env)
    bare = full["bare_images_per_second"]

    print(f"\n## Pipeline (Fashion-MNIST PNGs from the Debian package, batch {batch})")
    print("| run | images | encoded | flow wall s | images/s | peak RSS MiB |\n|---|---:|---:|---:|---:|---:|")
    for name, run, n in (("full, small", small, args.small), ("full, large", full, args.images),
                         ("no-op nightly, large", noop, args.images)):
        print(f"| {name} | {n} | {run['encoded']} | {run['wall_seconds']} | {run['images_per_second']} | "
              f"{run['peak_rss_mib']} |")
    print(f"\npipeline / bare model at batch {batch} (bare measured for 20 s in the same process right after): "
          f"{full['images_per_second']:.1f} / {bare:.1f} = {full['images_per_second'] / bare:.2f} (goal >= 0.9)")
    print(f"no-op nightly / full run (flow wall time): {noop['wall_seconds']} / {full['wall_seconds']} = "
          f"{noop['wall_seconds'] / full['wall_seconds']:.4f} (goal < 0.02); decoded {noop['encoded']} images, "
          f"read {noop['shards']} shards")
    print(f"peak RSS large / small ({args.images} vs {args.small} images): {full['peak_rss_mib']} / "
          f"{small['peak_rss_mib']} = {full['peak_rss_mib'] / small['peak_rss_mib']:.2f} (goal: flat, ~1.0)")


if __name__ == "__main__":
    main()
