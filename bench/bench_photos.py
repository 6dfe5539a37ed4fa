"""Ingest throughput on product-sized photos, where decoding, not the model, is the limit.

    .venv/bin/python bench/bench_photos.py [--images 300] [--workers 2]

The catalogue: `imgest.images.demo.product_photos`, real photos (scikit-image's) scaled to 800-2000 px,
cropped, re-encoded as JPEG at quality 85-95, a third progressive. Measured in one process, one run, on
the same images: JPEG decode img/s on one core (full and reduced), the bare model's img/s at the tuned
batch on preprocessed pixels, and encode_shard end to end (read, hash, decode in threads, encode, write
the Parquet shard) with the full and the reduced decode. Ratios are the figures to read.

Then threads against processes for the decode (read, hash, reduced decode, preprocess), feeding the same
batched encoder, with the decode workers and torch's threads split over the cores in each way that fits
2 cores: which wins is the answer to "threads or processes" (issue 12).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _prepare(path: str, side: int) -> np.ndarray:
    """What a decode worker does for one object, as a top-level function a process pool can call."""
    import hashlib

    from imgest.encoders.efficientnet import preprocess
    from imgest.images.decode import decode_image

    with open(path, "rb") as fh:
        data = fh.read()
    hashlib.sha256(data).hexdigest()
    return preprocess(decode_image(data, min_side=side))


def decode_and_encode(encoder, paths, batch: int, pool) -> float:
    """img/s: decode on `pool` (in order, a bounded window ahead), encode batches here."""
    from functools import partial

    start, done, pending = time.perf_counter(), 0, []
    for pixels in pool.map(partial(_prepare, side=encoder.decode_side), paths):
        pending.append(pixels)
        if len(pending) == batch:
            encoder.encode_images(np.stack(pending))
            done, pending = done + len(pending), []
    if pending:
        encoder.encode_images(np.stack(pending))
        done += len(pending)
    return done / (time.perf_counter() - start)


def rate(fn, items) -> float:
    start = time.perf_counter()
    for item in items:
        fn(item)
    return len(items) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--workers", type=int, default=0, help="decode workers of the pipeline (0: imgest's "
                                                                 "default, sized from the cores)")
    args = parser.parse_args()

    from imgest import encoders
    from imgest.images.decode import decode_image
    from imgest.images.demo import product_photos
    from imgest.storage import Location
    from imgest.tasks.ingest.batch_size import measure, tune_batch_size
    from imgest.tasks.ingest.encode import encode_shard
    from imgest.tasks.ingest.plan import ShardPlan, WorkItem

    files = product_photos(args.images)
    sizes = [len(b) for b in files.values()]
    pngs = sum(1 for k in files if k.endswith(".png"))
    print(f"catalogue: {len(files)} objects ({len(files) - pngs} JPEGs, {pngs} PNGs), {np.mean(sizes) / 1e3:.0f} kB "
          f"mean, {sum(sizes) / 1e6:.1f} MB")
    encoder = encoders.load(encoders.resolve("efficientnet-lite0"), "cpu")
    side = encoder.decode_side
    sample = list(files.values())[:60]
    full_rate = rate(lambda b: decode_image(b), sample)
    reduced_rate = rate(lambda b: decode_image(b, min_side=side), sample)
    print(f"decode on one core: full {full_rate:.1f} img/s, reduced {reduced_rate:.1f} img/s "
          f"({reduced_rate / full_rate:.2f}x)")

    tuning = tune_batch_size(encoder, min_seconds=2.0)
    bare = measure(encoder, tuning.batch_size, min_seconds=5.0)
    print(f"bare model: {bare:.1f} img/s at batch {tuning.batch_size} (tuning {tuning.measured})")

    results = {}
    with tempfile.TemporaryDirectory() as root:
        cat = Location(os.path.join(root, "catalogue"))
        for key, data in files.items():
            cat.write_bytes(key, data)
        items = tuple(WorkItem(k, cat.uri(k), len(b), None, None, None) for k, b in files.items())
        for name, decode_side in (("full decode", None), ("reduced decode", side)):
            encoder.decode_side = decode_side
            store = Location(os.path.join(root, name.replace(" ", "-")))
            start = time.perf_counter()
            result = encode_shard(ShardPlan("r00000001-bench-photos", 0, items), encoder, cat, store,
                                  tuning.batch_size, decode_workers=args.workers)
            results[name] = result.encoded / (time.perf_counter() - start)
            print(f"pipeline, {name}: {results[name]:.1f} img/s = {results[name] / bare:.2f} x bare "
                  f"({result.decode}; encoder waited {result.wait_seconds} s for decode, encoded "
                  f"{result.encode_seconds} s)")
        encoder.decode_side = side
        print(f"pipeline / bare: {results['full decode'] / bare:.2f} (full decode) -> "
              f"{results['reduced decode'] / bare:.2f} (reduced decode)")

        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

        import torch

        paths = [cat.path(k) for k in files]
        cores = os.cpu_count() or 1
        print(f"decode workers vs torch threads on {cores} cores (reduced decode, batch {tuning.batch_size}):")
        for torch_threads, workers in ((cores, cores), (max(1, cores - 1), 1)):
            torch.set_num_threads(torch_threads)
            line = []
            for kind, make in (("threads", lambda n: ThreadPoolExecutor(n)),
                               ("processes", lambda n: ProcessPoolExecutor(
                                   n, mp_context=multiprocessing.get_context("spawn")))):
                with make(workers) as pool:
                    list(pool.map(_prepare, paths[:workers], [side] * workers))  # start the workers first
                    got = decode_and_encode(encoder, paths, tuning.batch_size, pool)
                line.append(f"{kind} {got:.1f} img/s ({got / bare:.2f} x bare)")
            print(f"  torch {torch_threads} thread(s), {workers} decode worker(s): " + ", ".join(line))
        torch.set_num_threads(cores)


if __name__ == "__main__":
    main()
