"""Encoder runtimes and precisions: the bare model, the ingest pipeline end to end, and what precision and the
reduced decode cost in retrieval, measured in one run.

    OPENBLAS_CORETYPE=Haswell .venv/bin/python bench/bench_runtimes.py --images 600 --emoji-dir /tmp/emoji

1. Bare model (EfficientNet-Lite0) per runtime and precision, on one thread and on every core, and its parity
   figures against torch fp32 on the parity sample; bf16 as it runs (the stem and first block in fp32) and with
   every layer in bf16, shown even where the parity check refuses it.
2. The pipeline (read, hash, decode in processes, encode, write the shard: `encode_shard`) on ~1200 px product
   JPEGs at `--runtime torch --precision fp32` with Pillow's decoder (the old path), `openvino fp32` and the
   defaults (auto, auto, the JPEG decoder measured fastest), in alternating rounds (each shard decodes on the
   processes the one before left, as a run's shards do; the first starts them); images/s, the work bound
   (cores / (decode + encode core-seconds per image), both measured here) and the min cosine of each run's
   embeddings against the torch fp32 run's, item by item. Before it, each installed JPEG decoder's core-ms per
   photo (read, hash, decode, preprocess) as the run measures it to choose, and JPEGs' and PNG cut-outs' alone.
3. Image queries: one ~1200 px product JPEG at a time, decoded, preprocessed and encoded by what `imgest search`
   and the service use for a version (`query_encoder`: the runtime and precision its card says encoded the
   catalogue: OpenVINO fp32, and OpenVINO bf16 where it is native) against eager torch fp32; p50 and p90 over
   the photos.
4. Retrieval on a real shift (the same emoji drawn by Google and by Twitter, rendered as 800-1400 px product
   JPEGs; catalogue Google, queries Twitter; `npm pack emoji-datasource-{google,twitter}@16.0.0` in
   --emoji-dir), exact search: recall@1/10 with OpenVINO fp32, OpenVINO bf16 (as it runs, and every layer in
   bf16), torch bf16, and a store mixing precisions (bf16 queries against an fp32 catalogue), each with its
   paired-bootstrap interval against fp32.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def every_layer_bf16(plain, runtime: str):
    """The tower with no layer kept in fp32 under bf16 (how bf16 ran before the split), for comparison."""
    twin = copy.copy(plain)
    twin._split = None
    return twin.compiled_as(runtime, "bf16")


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
    kept = plain.graphs()["image"].kept_fp32("bf16")
    for runtime, precision, every_layer in (("torch", "fp32", False), ("torch", "bf16", False),
                                            ("torch", "bf16", True), ("openvino", "fp32", False),
                                            ("openvino", "bf16", False), ("openvino", "bf16", True)):
        encoder = plain if (runtime, precision) == ("torch", "fp32") else \
            every_layer_bf16(plain, runtime) if every_layer else plain.compiled_as(runtime, precision)
        label = f"{precision}, every layer" if every_layer else \
            f"{precision} ({kept} in fp32)" if precision != "fp32" and kept else precision
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
        print(f"| {runtime} | {label} | {rates[0]:.1f} | {rates[1]:.1f} | {figures['min_cosine']:.6f} | "
              f"{figures['mean_cosine']:.6f} | {figures['p1_cosine']:.6f} | {figures['overlap']:.3f} | {verdict} |",
              flush=True)


def decode_costs(cat, items, encoder) -> tuple[str, float, dict[str, float]]:
    """The run's own measurement (tasks/ingest/encode.py `decode_cost`) on 120 of the photos: the decoder it
    chooses, the cost with it (reading included), and each installed decoder's cost."""
    from imgest.tasks.ingest.encode import decode_cost

    cost = decode_cost(cat, items[:120], encoder, 10**9, sample=120)
    return cost.decoder, cost.seconds, cost.measured


def pipeline(args, spec, work: str) -> None:
    import torch

    from imgest import encoders
    from imgest.images.demo import product_photos
    from imgest.state.layout import shard_key
    from imgest.state.shards import embedding_matrix
    from imgest.storage import Location
    from imgest.tasks.ingest.batch_size import choose_encoding, measure
    from imgest.tasks.ingest.decode_workers import plan_decode
    from imgest.tasks.ingest.encode import encode_shard
    from imgest.tasks.ingest.plan import ShardPlan, WorkItem

    files = product_photos(args.images, seed=1, sides=(1100, 1300))
    cat = Location(os.path.join(work, "catalogue"))
    for key, data in files.items():
        cat.write_bytes(key, data)
    items = tuple(WorkItem(k, cat.uri(k), len(b), None, None, None) for k, b in files.items())
    sizes = [len(b) for b in files.values()]
    print(f"\n## Pipeline: {len(files)} product photos, 1100-1300 px wide, {np.mean(sizes) / 1e3:.0f} kB mean\n")
    tuning_store = os.path.join(work, "tuning-store")
    configs = {}
    decoder, decode_s, by_decoder = decode_costs(cat, items, encoders.load(spec, "cpu", "openvino", "fp32"))
    args.decoder = decoder  # the retrieval part decodes as this run would
    print("| JPEG decoder | core-ms per photo (hash, decode, preprocess) |\n|---|---:|")
    for name, cost in by_decoder.items():
        print(f"| {name}{' (chosen)' if name == decoder else ''} | {cost * 1e3:.2f} |")
    print(f"\nwith reading: {decode_s * 1e3:.2f} core-ms per photo, {decoder}", flush=True)
    from imgest.tasks.ingest.encode import decode_cost

    encoder = encoders.load(spec, "cpu", "openvino", "fp32")
    for kind, suffix in (("JPEGs", ".jpg"), ("PNG cut-outs", ".png")):
        alone = decode_cost(cat, tuple(i for i in items if i.item_id.endswith(suffix))[:120], encoder, 10**9, 120)
        print(f"{kind} alone: {alone.seconds * 1e3:.2f} core-ms each with reading", flush=True)
    print()
    for label, runtime, precision, jpeg in (("torch fp32, Pillow (the old path)", "torch", "fp32", "pillow"),
                                            ("openvino fp32", "openvino", "fp32", decoder),
                                            ("defaults (auto, auto)", "auto", "auto", decoder)):
        chosen = choose_encoding(tuning_store, spec, "cpu", runtime, precision)
        configs[label] = (encoders.load(spec, "cpu", chosen.runtime, chosen.precision), chosen, jpeg)
        print(f"- {label}: {chosen.runtime} {chosen.precision}, batch {chosen.batch_size} ({chosen.source}); "
              f"not used: {'; '.join(chosen.refused) or 'none'}", flush=True)
    cores = os.cpu_count() or 1
    old_s = by_decoder["pillow"] + decode_s - by_decoder[decoder]  # Pillow's, reading included as in decode_s
    rates: dict[str, list[float]] = {label: [] for label in configs}
    vectors: dict[str, dict[str, np.ndarray]] = {}
    for round_ in range(args.rounds):
        for label, (encoder, chosen, jpeg) in configs.items():
            store = Location(os.path.join(work, f"store-{round_}-{len(vectors)}-{chosen.runtime}"))
            start = time.perf_counter()
            result = encode_shard(ShardPlan("r00000001-bench-runtimes", round_, items), encoder, cat, store,
                                  chosen.batch_size, costs=(decode_s if jpeg == decoder else old_s,
                                                            chosen.encode_seconds or decode_s), decoder=jpeg)
            rates[label].append(result.encoded / (time.perf_counter() - start))
            table = store.read_table(shard_key(spec.slug, result.shard))
            vectors[label] = dict(zip(table.column("item_id").to_pylist(), embedding_matrix(table, spec.dim)))
            print(f"  round {round_ + 1}, {label}: {rates[label][-1]:.1f} img/s ({result.decode}; encoder waited "
                  f"{result.wait_seconds} s, encoded {result.encode_seconds} s)", flush=True)
    print()
    print("| run | runtime | JPEG decoder | batch | img/s (median) | x torch fp32 | decode core-ms/img | "
          "encode core-ms/img | work bound img/s | of the bound | min cosine to the old path |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = statistics.median(rates["torch fp32, Pillow (the old path)"])
    reference = vectors["torch fp32, Pillow (the old path)"]
    for label, (encoder, chosen, jpeg) in configs.items():
        jpeg_s = decode_s if jpeg == decoder else old_s
        plan = plan_decode(encoder, 0, len(items), False, (jpeg_s, chosen.encode_seconds or jpeg_s))
        torch.set_num_threads(plan.torch_threads or cores)
        encode_s = (plan.torch_threads or cores) / measure(encoder, chosen.batch_size, min_seconds=args.seconds)
        torch.set_num_threads(cores)
        bound = cores / (jpeg_s + encode_s)
        got = statistics.median(rates[label])
        cos = min(float(np.dot(reference[k], v)) for k, v in vectors[label].items())
        print(f"| {label} | {chosen.runtime} {chosen.precision} | {jpeg} | {chosen.batch_size} | {got:.1f} | "
              f"{got / base:.2f} | {jpeg_s * 1e3:.2f} | {encode_s * 1e3:.2f} | {bound:.1f} | {got / bound:.2f} | "
              f"{cos:.6f} |", flush=True)


def queries(args, spec) -> None:
    from imgest import encoders
    from imgest.encoders import precision
    from imgest.images.decode import decode_image
    from imgest.images.demo import product_photos
    from imgest.retrieval.query import query_encoder

    photos = [d for d in product_photos(args.query_photos, seed=2, sides=(1100, 1300)).values()]
    # a catalogue encoded by OpenVINO fp32, and one by OpenVINO bf16 where it is native (as each one's card says)
    made_by = ["openvino fp32"] + (["openvino bf16"] if "bf16" in precision.native_precisions("cpu") else [])
    print(f"\n## Image queries: {len(photos)} product photos, 1100-1300 px, one at a time (decode, preprocess, "
          "encode)\n")
    print("| query encoder | p50 ms | p90 ms | x eager torch at p50 |")
    print("|---|---:|---:|---:|")
    rows = {}
    for label, encoder in (("eager torch fp32", encoders.load(spec, "cpu")), *(
            (f"a catalogue encoded by {by} (query_encoder)",
             query_encoder(spec, "cpu", {"slug": spec.slug, "version": 1, "encoded_by": {by: 1}})) for by in made_by)):
        encoder.encode_images(np.stack([encoder.preprocess(decode_image(photos[0], min_side=encoder.decode_side))]))
        took = []
        for data in photos:
            start = time.perf_counter()
            encoder.encode_images(np.stack([encoder.preprocess(decode_image(data, min_side=encoder.decode_side))]))
            took.append((time.perf_counter() - start) * 1e3)
        rows[label] = np.percentile(took, [50, 90])
        base = rows["eager torch fp32"][0]
        print(f"| {label} ({encoder.runtime} {encoder.precision}) | {rows[label][0]:.1f} | {rows[label][1]:.1f} | "
              f"{base / rows[label][0]:.2f} |", flush=True)


def retrieval(args, spec, work: str) -> None:
    import bench_heads_shift as shift

    from imgest import encoders
    from imgest.images.decode import decode_image
    from imgest.retrieval.metrics import paired_bootstrap

    entries, archives = shift.artwork(args.emoji_dir)
    rng = np.random.default_rng(0)
    entries = [entries[i] for i in rng.permutation(len(entries))[:args.emoji]]
    pictures = {}
    for vendor in ("google", "twitter"):
        pictures[vendor] = [shift.render(archives[vendor].extractfile(
            f"package/img/{vendor}/64/{e['image']}").read(), rng) for e in entries]
    asked = np.arange(0, len(entries), max(1, len(entries) // args.queries))[:args.queries]
    plain = encoders.load(spec, "cpu")
    encoders_ = {"openvino fp32": plain.compiled_as("openvino", "fp32"),
                 "openvino bf16": plain.compiled_as("openvino", "bf16"),
                 "openvino bf16, every layer": every_layer_bf16(plain, "openvino"),
                 "torch bf16": plain.compiled_as("torch", "bf16")}

    def embed(encoder, datas):
        out = []
        for begin in range(0, len(datas), 32):
            batch = np.stack([encoder.preprocess(decode_image(d, min_side=encoder.decode_side, decoder=args.decoder))
                              for d in datas[begin:begin + 32]])
            out.append(encoder.encode_images(batch))
        return np.concatenate(out)

    catalogue, query = {}, {}
    for label, encoder in encoders_.items():
        catalogue[label] = embed(encoder, pictures["google"])
        query[label] = embed(encoder, [pictures["twitter"][i] for i in asked])
        print(f"  embedded: {label}", flush=True)

    def hits(q: str, c: str) -> tuple[np.ndarray, np.ndarray]:
        top = np.argsort(-(query[q] @ catalogue[c].T), axis=1)[:, :10]
        return (top[:, 0] == asked).astype(float), np.array([a in row for a, row in zip(asked, top)], float)

    runs = {"fp32 queries, fp32 catalogue (OpenVINO)": hits("openvino fp32", "openvino fp32"),
            "bf16 queries, bf16 catalogue (OpenVINO)": hits("openvino bf16", "openvino bf16"),
            "bf16 queries, bf16 catalogue, every layer in bf16 (OpenVINO)": hits("openvino bf16, every layer",
                                                                               "openvino bf16, every layer"),
            "bf16 queries, bf16 catalogue (torch autocast)": hits("torch bf16", "torch bf16"),
            "bf16 queries, fp32 catalogue (a store mixing both; OpenVINO)": hits("openvino bf16", "openvino fp32"),
            "fp32 queries, bf16 catalogue (OpenVINO)": hits("openvino fp32", "openvino bf16")}
    base = runs["fp32 queries, fp32 catalogue (OpenVINO)"]
    print(f"\n## Retrieval across a real shift: {len(entries)} Google emoji as the catalogue, {len(asked)} Twitter "
          "drawings as queries (exact search; Lite0, decoded as ingest does)\n")
    print("| queries, catalogue | recall@1 | recall@10 | recall@1 - fp32 [95% interval] | "
          "recall@10 - fp32 [95% interval] |")
    print("|---|---:|---:|---:|---:|")
    for label, (r1, r10) in runs.items():
        b1, b10 = paired_bootstrap(base[0], r1), paired_bootstrap(base[1], r10)
        print(f"| {label} | {r1.mean():.4f} | {r10.mean():.4f} | {b1['difference']:+.4f} [{b1['low']:+.4f}, "
              f"{b1['high']:+.4f}] | {b10['difference']:+.4f} [{b10['low']:+.4f}, {b10['high']:+.4f}] |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="per bare-model measurement")
    parser.add_argument("--emoji-dir", default=None, help="folder for the emoji packages (skip part 3 without)")
    parser.add_argument("--emoji", type=int, default=1911, help="catalogue items of part 3")
    parser.add_argument("--queries", type=int, default=1911, help="queries of part 4 (every emoji by default)")
    parser.add_argument("--query-photos", type=int, default=100, help="photos of part 3")
    parser.add_argument("--skip", default="", help="comma list of parts to skip: bare, pipeline, queries, retrieval")
    args = parser.parse_args()
    args.decoder = "pillow"  # until the pipeline part measures the decoders
    sys.path.insert(0, os.path.join(ROOT, "bench"))

    import openvino
    import torch

    from imgest import encoders
    from imgest.encoders import precision

    spec = encoders.resolve("efficientnet-lite0")
    print(f"# Encoder runtimes ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    print(f"{os.cpu_count()} cores, torch {torch.__version__}, openvino {openvino.get_version()}, native "
          f"precisions: {', '.join(precision.native_precisions('cpu'))}; {spec.model_id}")
    with tempfile.TemporaryDirectory() as work:
        os.environ.setdefault("IMGEST_COMPILED_CACHE", os.path.join(work, "compiled"))
        if "bare" not in args.skip:
            bare(args, spec)
        if "pipeline" not in args.skip:
            pipeline(args, spec, work)
        if "queries" not in args.skip:
            queries(args, spec)
        if args.emoji_dir and "retrieval" not in args.skip:
            retrieval(args, spec, work)


if __name__ == "__main__":
    main()
