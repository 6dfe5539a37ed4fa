"""What keeping pixels costs a decode worker, by the side kept against the model's own decode side, in one run.

    .venv/bin/python bench/bench_kept_side.py [--images 64] [--side 448] [--model efficientnet-lite0]

On `imgest.images.demo.product_photos` at 1100-1300 px (JPEG q85-95, a third progressive, every fifth EXIF-turned, every
tenth a PNG cut-out), one core, the model's own preprocessing: core-ms per image of a decode worker's work
(`tasks.ingest.encode.prepare`: read, hash, decode, preprocess, and the copy when one is kept) with the model's
default decode (simplejpeg down to its side), for no copy, a copy at the model's side (made from its decode), and a
copy at `--side` (above the model's: the model's pixels from its own decode, the copy from a second decode at
`--side`). The better of three rounds, taken in turn. Also checks what matters more than the cost: the model's
pixels are identical in every case.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def cpu_name() -> str:
    with open("/proc/cpuinfo") as fh:
        return next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")),
                    platform.machine())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--side", type=int, default=448)
    parser.add_argument("--model", default="efficientnet-lite0")
    args = parser.parse_args()

    import numpy as np
    import torch

    torch.set_num_threads(1)
    from imgest import encoders
    from imgest.images import decoders
    from imgest.images.demo import product_photos
    from imgest.storage import Location
    from imgest.tasks.ingest.encode import prepare
    from imgest.tasks.ingest.plan import WorkItem
    from tests.helpers import write_files

    encoder = encoders.load(encoders.resolve(args.model), "cpu", "torch", "fp32")
    side = encoder.decode_side
    photos = product_photos(args.images, seed=11, sides=(1100, 1300))
    with tempfile.TemporaryDirectory() as work:
        write_files(work, photos)
        catalogue = Location(work)
        items = [WorkItem(key, catalogue.uri(key), len(data), None, None, None) for key, data in photos.items()]
        cases = {"no copy": 0, f"copy at {side} (the model's side)": side, f"copy at {args.side}": args.side}
        best = {name: float("inf") for name in cases}
        pixels: dict[str, list] = {}
        for _ in range(3):
            for name, keep in cases.items():
                start = time.thread_time()
                done = [prepare(catalogue, item, encoder.preprocess, 10**8, side, decoder=decoders.DEFAULT,
                                keep_side=keep) for item in items]
                best[name] = min(best[name], (time.thread_time() - start) / len(items))
                pixels[name] = [d.pixels for d in done]
        same = all(all(np.array_equal(a, b) for a, b in zip(pixels["no copy"], other)) for other in pixels.values())
    print(f"# {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {cpu_name()}, "
          f"{args.images} photos at 1100-1300 px, {args.model} (decode side {side}), {decoders.DEFAULT}, one core")
    print("| a decode worker's work per image | core-ms | x no copy |")
    print("|---|---:|---:|")
    for name, seconds in best.items():
        print(f"| {name} | {seconds * 1e3:.2f} | {seconds / best['no copy']:.2f} |")
    print(f"the model's pixels identical in every case: {same}")


if __name__ == "__main__":
    main()
