"""GPU check: the GPU path for the models users run, on one GPU, in one script, in minutes.

    PYTHONPATH=. python bench/gpu_check.py [--images 600] [--out gpu_check.json]
    PYTHONPATH=. python bench/gpu_check.py --smoke    # the same code on this CPU: tiny models, 24 photos

Needs torch with CUDA, torchvision (imgest[gpu]: nvJPEG), transformers, Pillow, simplejpeg, scikit-image and the
EfficientNet-Lite0 weights package; not Prefect, not faiss (the encode path imports neither). About 6 minutes on one
H100 at the defaults; `--smoke` runs every step on the CPU with tiny models and a CPU stand-in for nvJPEG, so the
script is known to run before a GPU is lent.

Per model: EfficientNet-Lite0 (its packaged weights); CLIP ViT-B/32 and DINOv2 base at their real size with
random weights, built from transformers' default configs offline with their processors' published settings
(bench/bench_hf_models.py `build`) and loaded through `hf:<folder>` as a run loads them:
1. the batch a run would choose on the GPU (`tune_batch_size`, at the device's default precision) and its bare
   img/s, with the device memory free before it;
2. end to end on product photos (800-2000 px; every fifth stored sideways with an EXIF turn, every tenth a PNG
   cut-out): `encode_shard` with the CPU decode (the model's default decoder down to its decode side, in decode
   threads) and with nvJPEG (BatchJpegDecoder: each batch decoded whole on the GPU, reduced in the DCT domain to
   the CPU decoders' eighths, turned upright by its EXIF header, resized and cropped there as the model's
   preprocessing does): img/s, and the nvJPEG path's counts: decoded on the GPU, fallen back to the CPU path, over
   the device budget, parts split after an out-of-memory error, the most pixels one call held; each run's
   device memory peak;
3. the nvJPEG path's embeddings against the CPU path's, image by image: min, mean and 1st-percentile cosine,
   neighbour overlap, the decoder gate's verdict (imgest/encoders/parity.py), and the minimum over the
   EXIF-turned photos alone (a photo encoded sideways would show there).
One JSON (--out); each figure is printed as it comes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
STARTED = time.perf_counter()
MAX_PIXELS = 100_000_000


def say(line: str) -> None:
    print(f"[{time.perf_counter() - STARTED:6.0f} s] {line}", flush=True)


def stand_in(raw: list, device: str) -> list:
    """--smoke: nvJPEG's contract on the CPU (each JPEG whole, RGB, as stored; one bad image fails the call)."""
    import simplejpeg
    import torch

    return [torch.from_numpy(simplejpeg.decode_jpeg(t.numpy().tobytes(), colorspace="RGB").transpose(2, 0, 1)
                             .copy()).to(device) for t in raw]


def tiny(kind: str, folder: str) -> str:
    """--smoke: a small random model of `kind` with the real processor's settings."""
    from bench_hf_models import IMAGENET_MEAN, IMAGENET_STD
    from transformers import BitImageProcessor, CLIPConfig, CLIPImageProcessor, CLIPModel, Dinov2Config, Dinov2Model

    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, patch_size=32)
    if kind == "clip":
        model = CLIPModel(CLIPConfig(vision_config={**vision, "image_size": 224}, projection_dim=24,
                                     text_config={**vision, "vocab_size": 64, "max_position_embeddings": 16}))
        processor = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
    else:
        model = Dinov2Model(Dinov2Config(**{**vision, "patch_size": 14, "image_size": 224}))
        processor = BitImageProcessor(size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224},
                                      image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD)
    model.eval().save_pretrained(folder, safe_serialization=True)
    processor.save_pretrained(folder)
    if kind == "clip":
        from bench_hf_models import save_tokenizer

        save_tokenizer(folder, 64, {0: "[BOS]", 1: "[EOS]"}, "[BOS] $A [EOS]", "[EOS]", 16)
    return folder


def embeddings(store, slug: str, result, dim: int) -> tuple[list[str], np.ndarray]:
    from imgest.state.layout import shard_key
    from imgest.state.shards import embedding_matrix

    table = store.read_table(shard_key(slug, result.shard))
    return table.column("item_id").to_pylist(), embedding_matrix(table, dim)


def check_model(name: str, label: str, files: dict[str, bytes], root: str, device: str, smoke: bool) -> dict:
    import torch

    from imgest import encoders
    from imgest.encoders import parity
    from imgest.images import decoders, tensors
    from imgest.storage import Location
    from imgest.tasks.ingest.batch_size import tune_batch_size
    from imgest.tasks.ingest.encode import encode_shard
    from imgest.tasks.ingest.gpu_decode import BatchJpegDecoder
    from imgest.tasks.ingest.plan import ShardPlan, WorkItem

    on_gpu = device.startswith("cuda")
    out: dict = {"model": label}
    spec = encoders.resolve(name)
    encoder = encoders.load(spec, device)
    out["model_id"], out["precision"], out["decode_side"] = spec.model_id, encoder.precision, encoder.decode_side
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
        out["device_free_bytes_before"] = torch.cuda.mem_get_info()[0]
    tuning = tune_batch_size(encoder, candidates=(4, 8) if smoke else None, min_seconds=0.2 if smoke else 1.0)
    batch = tuning.batch_size
    out["tuned_batch"], out["bare_images_per_second_by_batch"] = batch, tuning.measured
    say(f"{label}: batch {batch} ({tuning.stopped}); bare img/s {tuning.measured}")

    cat = Location(os.path.join(root, "catalogue"))
    items = tuple(WorkItem(k, cat.uri(k), len(b), None, None, None) for k, b in files.items())
    threads = 2 if smoke else min(16, os.cpu_count() or 1)
    runs, shards = {}, {}
    for way in ("cpu", "nvjpeg"):
        if way == "cpu":
            jpeg, decoder = None, decoders.DEFAULT
        elif smoke:
            jpeg = BatchJpegDecoder(device, encoder.resample_plan, encoder.preprocess, MAX_PIXELS,
                                    encoder.decode_side, decode_fn=stand_in, free_memory=lambda: 1 << 34)
            decoder = decoders.DEFAULT  # the stand-in decodes; nothing here is nvJPEG
        else:
            jpeg, decoder = BatchJpegDecoder.for_encoder(encoder, MAX_PIXELS), decoders.NVJPEG
            if jpeg is None:
                runs[way] = "not measured: torchvision's nvJPEG is not installed here (pip install 'imgest[gpu]')"
                say(f"{label}: {runs[way]}")
                continue
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        store = Location(os.path.join(root, f"store-{spec.slug}-{way}"))
        start = time.perf_counter()
        result = encode_shard(ShardPlan(f"r00000001-gpu-check-{way}", 0, items), encoder, cat, store, batch,
                              decode_workers=threads, max_pixels=MAX_PIXELS, jpeg_decoder=jpeg, decoder=decoder)
        seconds = time.perf_counter() - start
        run = {"images_per_second": round(result.encoded / seconds, 1), "encoded": result.encoded,
               "rejected": len(result.rejected), "decode": result.decode, "decode_threads": threads,
               "encoder_waited_seconds": result.wait_seconds}
        if jpeg is not None:
            run.update(gpu_decoded=jpeg.gpu_decoded, fallbacks=jpeg.fallbacks, over_budget=jpeg.over_budget,
                       splits=jpeg.splits, largest_part_pixels=jpeg.largest_part, budget_pixels=jpeg.budget())
        if on_gpu:
            run["device_memory_peak_bytes"] = int(torch.cuda.max_memory_allocated())
        runs[way] = run
        shards[way] = embeddings(store, spec.slug, result, spec.dim)
        say(f"{label}, {way} decode: {run}")
    out["end_to_end"] = runs
    if len(shards) == 2:
        (ids_a, cpu), (ids_b, gpu) = shards["cpu"], shards["nvjpeg"]
        assert ids_a == ids_b, "the two runs encoded different items"
        cos = np.sum(cpu * gpu, axis=1)
        turned = np.array([tensors.orientation(files[i]) != 1 for i in ids_a])
        figures = parity.paired(cpu, gpu)
        out["nvjpeg_vs_cpu"] = {**figures, "images": len(ids_a), "gate": parity.gate("bf16"),
                                "passes_decoder_gate": parity.passes(figures, "bf16"),
                                "exif_turned_images": int(turned.sum()),
                                "exif_turned_min_cosine": float(cos[turned].min()) if turned.any() else None}
        say(f"{label}: nvJPEG path against the CPU path: {out['nvjpeg_vs_cpu']}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--smoke", action="store_true", help="run every step on this CPU, tiny models, 24 photos")
    args = parser.parse_args()

    import torch

    device = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        from imgest.encoders import unusable_gpu

        sys.exit(f"no usable CUDA device: {unusable_gpu() or 'no GPU here'} (--smoke runs the steps on the CPU)")
    report: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "cpu_cores": os.cpu_count(),
                    "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None, "smoke": args.smoke}
    from imgest.images.demo import product_photos

    with tempfile.TemporaryDirectory() as root:
        os.environ["IMGEST_COMPILED_CACHE"] = os.path.join(root, "compiled")
        models = os.path.join(root, "models")
        os.environ["IMGEST_MODEL_DIRS"] = models
        files = product_photos(24 if args.smoke else args.images, seed=7)
        say(f"{len(files)} product photos made")
        from imgest.storage import Location

        cat = Location(os.path.join(root, "catalogue"))
        for key, data in files.items():
            cat.write_bytes(key, data)
        report["catalogue"] = {"images": len(files), "mean_bytes": int(np.mean([len(b) for b in files.values()]))}
        if args.smoke:
            build = tiny
        else:
            from bench_hf_models import build
        checks = [("efficientnet-lite0", "EfficientNet-Lite0")]
        for kind, label in (("clip", "CLIP ViT-B/32"), ("dinov2", "DINOv2 base")):
            checks.append((f"hf:{build(kind, os.path.join(models, kind))}", label + (" (tiny)" if args.smoke else "")))
        report["models"] = [check_model(name, label, files, root, device, args.smoke) for name, label in checks]
    report["seconds"] = round(time.perf_counter() - STARTED, 1)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2, default=str)
    say(f"written {args.out}")


if __name__ == "__main__":
    main()
