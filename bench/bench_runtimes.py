"""Encoder runtimes and precisions: the bare model, the ingest pipeline end to end, and what precision and the
reduced decode cost in retrieval, measured in one run.

    OPENBLAS_CORETYPE=Haswell .venv/bin/python bench/bench_runtimes.py --images 600 --emoji-dir /tmp/emoji

1. Bare model (EfficientNet-Lite0) per runtime and precision, on one thread and on every core, and its min
   cosine against torch fp32 on the parity sample (bf16 shown even where the parity check refuses it).
2. The pipeline (read, hash, decode in processes, encode, write the shard: `encode_shard`) on ~1200 px product
   JPEGs at `--runtime torch --precision fp32` (the old path), `openvino fp32` and the defaults (auto, auto),
   in alternating rounds; images/s, the work bound (cores / (decode + encode core-seconds per image), both
   measured here) and the min cosine of each run's embeddings against the torch fp32 run's, item by item.
3. Retrieval on a real shift (the same emoji drawn by Google and by Twitter, rendered as 800-1400 px product
   JPEGs; catalogue Google, queries Twitter; `npm pack emoji-datasource-{google,twitter}@16.0.0` in
   --emoji-dir): recall@1/10 with fp32 on the full decode, on the reduced decode at 2x and at 1x the side
   preprocessing needs, and with bf16; and the overlap@10 of each with the fp32 full-decode lists.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def bare(args, spec) -> None:
    import torch

    from imgest import encoders
    from imgest.encoders import parity
    from imgest.tasks.ingest.batch_size import measure

    plain = encoders.load(spec, "cpu")
    sample = parity.sample_batch(plain)
    reference = plain.encode_images(sample)
    cores = os.cpu_count() or 1
    print("\n## Bare model (Lite0, batch 16)\n")
    print(f"| runtime | precision | img/s, 1 thread | img/s, {cores} threads | min cosine to torch fp32 | mean | "
          f"1st percentile | overlap@10 | parity gate |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for runtime, precision in (("torch", "fp32"), ("torch", "bf16"), ("openvino", "fp32"), ("openvino", "bf16")):
        encoder = plain if (runtime, precision) == ("torch", "fp32") else plain.compiled_as(runtime, precision)
        got = encoder.encode_images(sample)
        cosines = (reference * got).sum(1)
        figures = {"min_cosine": float(cosines.min()), "mean_cosine": float(cosines.mean()),
                   "p1_cosine": float(np.percentile(cosines, 1)), "overlap": parity.neighbour_overlap(reference, got)}
        verdict = "passes" if parity.passes(figures, precision) else "refused"
        rates = []
        for threads in (1, cores):
            torch.set_num_threads(threads)
            rates.append(measure(encoder, 16, min_seconds=args.seconds))
        torch.set_num_threads(cores)
        print(f"| {runtime} | {precision} | {rates[0]:.1f} | {rates[1]:.1f} | {figures['min_cosine']:.6f} | "
              f"{figures['mean_cosine']:.6f} | {figures['p1_cosine']:.6f} | {figures['overlap']:.3f} | {verdict} |",
              flush=True)


def decode_cost(paths: list[str], side: int) -> float:
    """Core-seconds per image of what a decode worker does (read, hash, reduced decode, preprocess)."""
    import hashlib

    from imgest.encoders.efficientnet import preprocess
    from imgest.tasks.ingest.decode import decode_image

    start = time.process_time()
    for path in paths:
        with open(path, "rb") as fh:
            data = fh.read()
        hashlib.sha256(data).hexdigest()
        preprocess(decode_image(data, min_side=side))
    return (time.process_time() - start) / len(paths)


def pipeline(args, spec, work: str) -> None:
    import torch

    from imgest import encoders
    from imgest.demo import product_photos
    from imgest.storage import Location
    from imgest.tasks.ingest.batch_size import choose_encoding, measure
    from imgest.tasks.ingest.encode import encode_shard, plan_decode
    from imgest.tasks.ingest.plan import ShardPlan, WorkItem
    from imgest.tasks.ingest.shards import embedding_matrix
    from imgest.tasks.state.committed import shard_key

    files = product_photos(args.images, seed=1, sides=(1100, 1300))
    cat = Location(os.path.join(work, "catalogue"))
    for key, data in files.items():
        cat.write_bytes(key, data)
    items = tuple(WorkItem(k, cat.uri(k), len(b), None, None, None) for k, b in files.items())
    sizes = [len(b) for b in files.values()]
    print(f"\n## Pipeline: {len(files)} product photos, 1100-1300 px wide, {np.mean(sizes) / 1e3:.0f} kB mean\n")
    tuning_store = os.path.join(work, "tuning-store")
    configs = {}
    for label, runtime, precision in (("torch fp32 (the old path)", "torch", "fp32"),
                                      ("openvino fp32", "openvino", "fp32"), ("defaults (auto, auto)", "auto", "auto")):
        chosen = choose_encoding(tuning_store, spec, "cpu", runtime, precision)
        configs[label] = (encoders.load(spec, "cpu", chosen.runtime, chosen.precision), chosen)
        print(f"- {label}: {chosen.runtime} {chosen.precision}, batch {chosen.batch_size} ({chosen.source}); "
              f"not used: {'; '.join(chosen.refused) or 'none'}", flush=True)
    cores = os.cpu_count() or 1
    paths = [cat.path(k) for k in list(files)[:120]]
    decode_s = decode_cost(paths, configs["openvino fp32"][0].decode_side)
    rates: dict[str, list[float]] = {label: [] for label in configs}
    vectors: dict[str, dict[str, np.ndarray]] = {}
    for round_ in range(args.rounds):
        for label, (encoder, chosen) in configs.items():
            store = Location(os.path.join(work, f"store-{round_}-{len(vectors)}-{chosen.runtime}"))
            start = time.perf_counter()
            result = encode_shard(ShardPlan("r00000001-bench-runtimes", round_, items), encoder, cat, store,
                                  chosen.batch_size)
            rates[label].append(result.encoded / (time.perf_counter() - start))
            table = store.read_table(shard_key(spec.slug, result.shard))
            vectors[label] = dict(zip(table.column("item_id").to_pylist(), embedding_matrix(table, spec.dim)))
            print(f"  round {round_ + 1}, {label}: {rates[label][-1]:.1f} img/s ({result.decode}; encoder waited "
                  f"{result.wait_seconds} s, encoded {result.encode_seconds} s)", flush=True)
    print(f"\ndecode (read, hash, reduced decode, preprocess): {decode_s * 1e3:.2f} core-ms per image, one core\n")
    print("| run | runtime | batch | img/s (median) | x torch fp32 | encode core-ms/img | work bound img/s | "
          "of the bound | min cosine to torch fp32 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    base = statistics.median(rates["torch fp32 (the old path)"])
    reference = vectors["torch fp32 (the old path)"]
    for label, (encoder, chosen) in configs.items():
        plan = plan_decode(encoder, 0, len(items), False)
        torch.set_num_threads(plan.torch_threads or cores)
        encode_s = (plan.torch_threads or cores) / measure(encoder, chosen.batch_size, min_seconds=args.seconds)
        torch.set_num_threads(cores)
        bound = cores / (decode_s + encode_s)
        got = statistics.median(rates[label])
        cos = min(float(np.dot(reference[k], v)) for k, v in vectors[label].items())
        print(f"| {label} | {chosen.runtime} {chosen.precision} | {chosen.batch_size} | {got:.1f} | {got / base:.2f} "
              f"| {encode_s * 1e3:.2f} | {bound:.1f} | {got / bound:.2f} | {cos:.6f} |", flush=True)


def retrieval(args, spec, work: str) -> None:
    import bench_heads_shift as shift

    from imgest import encoders
    from imgest.tasks.ingest import decode

    entries, archives = shift.artwork(args.emoji_dir)
    rng = np.random.default_rng(0)
    entries = [entries[i] for i in rng.permutation(len(entries))[:args.emoji]]
    pictures = {}
    for vendor in ("google", "twitter"):
        pictures[vendor] = [shift.render(archives[vendor].extractfile(
            f"package/img/{vendor}/64/{e['image']}").read(), rng) for e in entries]
    queries = np.arange(0, len(entries), max(1, len(entries) // args.queries))[:args.queries]
    plain = encoders.load(spec, "cpu", "openvino", "fp32")
    half = plain.compiled_as("openvino", "bf16")

    def embed(encoder, datas, gap):
        decode.JPEG_REDUCING_GAP = gap
        side = encoder.decode_side if gap else None
        out = []
        for begin in range(0, len(datas), 32):
            batch = np.stack([encoder.preprocess(decode.decode_image(d, min_side=side))
                              for d in datas[begin:begin + 32]])
            out.append(encoder.encode_images(batch))
        return np.concatenate(out)

    runs = {}
    for label, encoder, gap in (("fp32, full decode", plain, 0), ("fp32, reduced to >= 2x the side", plain, 2),
                                ("fp32, reduced to >= 1x the side", plain, 1), ("bf16, reduced to >= 1x", half, 1)):
        catalogue = embed(encoder, pictures["google"], gap)
        asked = embed(encoder, [pictures["twitter"][i] for i in queries], gap)
        runs[label] = np.argsort(-(asked @ catalogue.T), axis=1)[:, :10]
        print(f"  embedded: {label}", flush=True)
    decode.JPEG_REDUCING_GAP = 1
    truth = runs["fp32, full decode"]
    print(f"\n## Retrieval across a real shift: {len(entries)} Google emoji as the catalogue, {len(queries)} "
          "Twitter drawings as queries (exact search)\n")
    print("| embeddings | recall@1 | recall@10 | overlap@10 with fp32 full decode |")
    print("|---|---:|---:|---:|")
    for label, top in runs.items():
        r1 = float(np.mean(top[:, 0] == queries))
        r10 = float(np.mean([q in row for q, row in zip(queries, top)]))
        overlap = float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(top, truth)]))
        print(f"| {label} | {r1:.3f} | {r10:.3f} | {overlap:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="per bare-model measurement")
    parser.add_argument("--emoji-dir", default=None, help="folder for the emoji packages (skip part 3 without)")
    parser.add_argument("--emoji", type=int, default=1911, help="catalogue items of part 3")
    parser.add_argument("--queries", type=int, default=600)
    parser.add_argument("--skip", default="", help="comma list of parts to skip: bare, pipeline, retrieval")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "bench"))

    import openvino
    import torch

    from imgest import encoders
    from imgest.encoders import runtimes

    spec = encoders.resolve("efficientnet-lite0")
    print(f"# Encoder runtimes ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    print(f"{os.cpu_count()} cores, torch {torch.__version__}, openvino {openvino.get_version()}, native "
          f"precisions: {', '.join(runtimes.native_precisions('cpu'))}; {spec.model_id}")
    with tempfile.TemporaryDirectory() as work:
        os.environ.setdefault("IMGEST_COMPILED_CACHE", os.path.join(work, "compiled"))
        if "bare" not in args.skip:
            bare(args, spec)
        if "pipeline" not in args.skip:
            pipeline(args, spec, work)
        if args.emoji_dir and "retrieval" not in args.skip:
            retrieval(args, spec, work)


if __name__ == "__main__":
    main()
