"""Transformers models at their real size on this CPU: CLIP ViT-B/32, SigLIP base 224 and DINOv2 base, through
imgest's `hf:<folder>` path, measured in one run.

    OPENBLAS_CORETYPE=Haswell .venv/bin/python bench/bench_hf_models.py [--photos 64] [--pipeline-photos 128]

No hub download: each model is built from transformers' default config (the base checkpoint's shape:
`CLIPConfig()` is ViT-B/32 at 224, `SiglipConfig()` SigLIP base patch16 224, `Dinov2Config()` DINOv2 base, patch
14) with random weights (torch.manual_seed(0)) and its processor's published settings, saved as a local folder
(safetensors; a word-level tokenizer for the text towers, which are not measured) under `--workdir`, listed in
IMGEST_MODEL_DIRS for this process, and loaded by `imgest.encoders.resolve` and `load` as a run loads it. Random
weights: the speeds are the weights' shapes; the parity figures say nothing about real weights' quality.

Per model:
1. Bare model img/s on preprocessed batches (`--batch`), on one thread and on every core: eager torch fp32,
   OpenVINO fp32, and OpenVINO bf16 where this CPU computes in it natively and its parity gate
   (imgest/encoders/parity.py) passes; each compiled one's gate figures (passed or refused).
2. Decode core-ms per photo on one thread (time.thread_time; decode and the encoder's preprocessing, the better of
   two rounds): the full decode (`decode_image(data)`) against the reduced one (`decode_image(data,
   min_side=encoder.decode_side, decoder="simplejpeg")`), on `--photos` product photos 1100-1300 px wide (a tenth
   PNG cut-outs, which no JPEG decoder reduces; JPEGs alone shown too), beside EfficientNet-Lite0 (its weights
   ship in a package) on the same photos: the reduced decode of each model against Lite0's.
3. The ingest pipeline end to end (`encode_shard`: read, hash, decode in processes, encode, write the shard) on
   `--pipeline-photos` of the same photos written as a folder catalogue, with the fastest runtime and precision
   that passed (on every core, as a run chooses), decoder simplejpeg, decoded down to the encoder's side as
   `encode_shard` does: once with the cores split by the measured costs as a run splits them (--decode-workers
   0), once with one decode process beside the encoder on every core (--decode-workers 1); `--rounds` shards
   each (the first starts the decode processes, ~5 core-seconds each with transformers' imports; the next reuse
   them, as a run's shards do: the figure is the median of the rounds after the first). img/s and the work
   bound, cores / (decode + encode core-seconds per image) as in bench/bench_runtimes.py: decode as the run
   measures it (read, hash, decode, preprocess), encode the bare model at the pipeline's thread count and batch.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

KINDS = ("clip", "siglip", "dinov2")
LABELS = {"clip": "CLIP ViT-B/32 (224)", "siglip": "SigLIP base patch16 224", "dinov2": "DINOv2 base (patch 14)",
          "lite0": "EfficientNet-Lite0"}
EXPECTED_SIDE = {"clip": 224, "siglip": 224, "dinov2": 256}
LITE0 = "efficientnet-lite0"
DECODER = "simplejpeg"
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
STARTED = time.perf_counter()


def say(line: str) -> None:
    print(f"[{time.perf_counter() - STARTED:6.0f} s] {line}", flush=True)


def save_tokenizer(folder: str, vocab_size: int, specials: dict[int, str], template: str, pad: str,
                   max_length: int) -> None:
    """A fast word-level tokenizer with the config's vocabulary size, its special tokens at the config's ids
    (CLIP pools the text at its end-of-text id), adding them as the model's own tokenizer does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["a", "an", "of", "on", "the", "with", "photo", "red", "blue", "white", "black", "shoe", "boot", "bag",
             "cup", "cat", "watch", "jacket", "leather", "wooden", "floor", "rocket"]
    vocab = {token: i for i, token in specials.items()}
    free = (i for i in range(vocab_size) if i not in specials)
    for word in [*words, "[UNK]"]:
        vocab.setdefault(word, next(free))
    for i in free:
        vocab[f"[unused{i}]"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[(t, vocab[t]) for t in specials.values() if t in template])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token=pad,
                            model_max_length=max_length).save_pretrained(folder)


def build(kind: str, folder: str) -> str:
    """The model at the base checkpoint's shape, random weights, and its processor as published."""
    import torch
    from transformers import (
        BitImageProcessor,
        CLIPConfig,
        CLIPImageProcessor,
        CLIPModel,
        Dinov2Config,
        Dinov2Model,
        SiglipConfig,
        SiglipImageProcessor,
        SiglipModel,
    )
    from transformers.image_utils import PILImageResampling

    torch.manual_seed(0)
    if kind == "clip":  # openai/clip-vit-base-patch32: OpenAI's mean and std are the processor's defaults
        model = CLIPModel(CLIPConfig())
        processor = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
    elif kind == "siglip":  # google/siglip-base-patch16-224
        # SiglipTextConfig's default bos/eos ids (49406, 49407) lie outside its 32,000 words; the real tokenizer
        # ends a text with </s> = 1, which is also its pad. Only the text tower reads them.
        model = SiglipModel(SiglipConfig(text_config={"bos_token_id": None, "eos_token_id": 1, "pad_token_id": 1}))
        processor = SiglipImageProcessor(size={"height": 224, "width": 224}, image_mean=[0.5] * 3,
                                         image_std=[0.5] * 3)
    elif kind == "dinov2":  # facebook/dinov2-base's preprocessor_config.json
        model = Dinov2Model(Dinov2Config())
        processor = BitImageProcessor(size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224},
                                      resample=PILImageResampling.BICUBIC, image_mean=IMAGENET_MEAN,
                                      image_std=IMAGENET_STD, do_convert_rgb=True)
    else:
        raise ValueError(kind)
    model.eval().save_pretrained(folder, safe_serialization=True)
    processor.save_pretrained(folder)
    if kind == "clip":
        text = model.config.text_config
        save_tokenizer(folder, text.vocab_size, {text.bos_token_id: "<|startoftext|>",
                                                 text.eos_token_id: "<|endoftext|>"},
                       "<|startoftext|> $A <|endoftext|>", "<|endoftext|>", text.max_position_embeddings)
    elif kind == "siglip":
        text = model.config.text_config
        save_tokenizer(folder, text.vocab_size, {1: "</s>"}, "$A </s>", "</s>", text.max_position_embeddings)
    return folder


def parity_record(plain, runtime: str, precision: str) -> dict | None:
    """The gate's figures as the check kept them beside the compiled model (imgest/encoders/parity.py `check`),
    passed or refused."""
    from imgest.encoders import compiled, device_key, parity

    graph = next(iter(plain.graphs().values()))
    _, runs_reduced = graph.parts(precision)
    entry = compiled.entry(plain.spec.model_id, runs_reduced, runtime, parity._runtime_version(runtime))
    return compiled.read_record(entry, parity._record_name(precision, device_key(plain.device, threads=False)))


def bare(spec, args) -> tuple[dict, dict]:
    """{label: (encoder, {threads: img/s})} for each runtime and precision that loads, and the gate figures."""
    import torch

    from imgest import encoders
    from imgest.encoders.precision import native_precisions
    from imgest.tasks.ingest.batch_size import measure

    cores = os.cpu_count() or 1
    plain = encoders.load(spec, "cpu", "torch", "fp32")
    rows, gates = {}, {}
    wanted = [("torch", "fp32"), ("openvino", "fp32")]
    if "bf16" in native_precisions("cpu"):
        wanted.append(("openvino", "bf16"))
    else:
        gates["openvino bf16"] = {"verdict": "not native on this CPU (no AMX or AVX-512 BF16): not tried"}
    for runtime, precision in wanted:
        label = f"{runtime} {precision}"
        say(f"{label}: loading (compile and parity check where it is compiled)")
        try:
            encoder = encoders.load(spec, "cpu", runtime, precision)
            verdict = "passes"
        except encoders.parity.ParityError as exc:
            encoder, verdict = None, f"refused: {exc}"
        except encoders.EncoderError as exc:  # a model the runtime cannot convert or run
            gates[label] = {"verdict": f"failed: {exc}"}
            say(f"{label}: {exc}")
            continue
        if (runtime, precision) != ("torch", "fp32"):
            gates[label] = {**(parity_record(plain, runtime, precision) or {}), "verdict": verdict}
            g = gates[label]
            say(f"{label}: parity {verdict.split(':')[0]} (min {g.get('min_cosine')}, mean {g.get('mean_cosine')}, "
                f"1st percentile {g.get('p1_cosine')}, overlap@10 {g.get('overlap')})")
        if encoder is None:
            continue
        rates = {}
        for threads in sorted({1, cores}):
            torch.set_num_threads(threads)
            rates[threads] = measure(encoder, args.batch, min_seconds=args.seconds)
            say(f"{label}: {rates[threads]:.2f} img/s at batch {args.batch} on {threads} thread(s)")
        torch.set_num_threads(cores)
        rows[label] = (encoder, rates)
    return rows, gates


def decode_figures(encoder, photos: dict[str, bytes], rounds: int = 2) -> dict:
    """Core-ms per photo on this thread (decode + the encoder's preprocessing), full and reduced, the better of
    `rounds` (taken in turn, so a moment of other work on the machine does not decide either), overall and for
    the JPEGs alone."""
    from imgest.images.decode import decode_image

    side = encoder.decode_side
    variants = {"full": lambda data: decode_image(data),
                "reduced": lambda data: decode_image(data, min_side=side, decoder=DECODER)}
    best = {(v, k): float("inf") for v in variants for k in ("all", "jpeg")}
    for _ in range(rounds):
        for name, decode in variants.items():
            spent = {"all": 0.0, "jpeg": 0.0}
            for key, data in photos.items():
                start = time.thread_time()
                encoder.preprocess(decode(data))
                took = time.thread_time() - start
                spent["all"] += took
                if key.endswith(".jpg"):
                    spent["jpeg"] += took
            for part, seconds in spent.items():
                best[name, part] = min(best[name, part], seconds)
    jpegs = sum(1 for k in photos if k.endswith(".jpg"))
    return {"decode_side": side, **{f"{name}_{part}_ms": round(best[name, part] * 1e3 / (jpegs if part == "jpeg"
                                                                                           else len(photos)), 3)
                                    for name, part in best}}


SPLITS = (("the run's split (--decode-workers 0)", 0), ("--decode-workers 1", 1))


def pipeline(spec, rows: dict, args, work: str, cat, items) -> dict:
    """`encode_shard` end to end with the fastest runtime and precision that passed, the cores split as a run
    splits them (--decode-workers 0) and with one decode process beside the encoder on every core
    (--decode-workers 1), each with its work bound."""
    import torch

    from imgest.names import DEFAULT_MAX_PIXELS
    from imgest.storage import Location
    from imgest.tasks.ingest.batch_size import measure
    from imgest.tasks.ingest.decode_workers import end_kept, plan_decode
    from imgest.tasks.ingest.encode import decode_cost, encode_shard
    from imgest.tasks.ingest.plan import ShardPlan

    cores = os.cpu_count() or 1
    label = max(rows, key=lambda k: rows[k][1][cores])  # as a run chooses: the fastest on every core
    encoder, rates = rows[label]
    cost = decode_cost(cat, items, encoder, DEFAULT_MAX_PIXELS, sample=min(len(items), 64), names=(DECODER,))
    decode_s = cost.seconds
    costs = (decode_s, cores / rates[cores])  # what a run measures before its first shard, to split the cores
    out = {"runtime": label, "batch": args.batch, "decode_core_ms": round(decode_s * 1e3, 2), "splits": {}}
    for name, workers in SPLITS:
        plan = plan_decode(encoder, workers, len(items), False, costs)
        threads = plan.torch_threads or cores
        if threads not in rates:
            torch.set_num_threads(threads)
            rates[threads] = measure(encoder, args.batch, min_seconds=args.seconds)
            torch.set_num_threads(cores)
        encode_s = threads / rates[threads]
        bound = cores / (decode_s + encode_s)
        say(f"pipeline, {name}: {label} at batch {args.batch}, {plan.describe()}; decode {decode_s * 1e3:.2f} "
            f"core-ms/photo (read, hash, decode, preprocess), encode {encode_s * 1e3:.1f} core-ms/img on {threads} "
            f"thread(s): bound {bound:.2f} img/s")
        got, described = [], ""
        try:
            for round_ in range(args.rounds):
                store = Location(os.path.join(work, "stores", f"{spec.slug}-{workers}-{round_}"))
                start = time.perf_counter()
                result = encode_shard(ShardPlan(f"r{round_ + 1:08d}-bench-hf", round_, items), encoder, cat, store,
                                      args.batch, decode_workers=workers, costs=costs, decoder=DECODER)
                got.append(result.encoded / (time.perf_counter() - start))
                described = result.decode
                say(f"pipeline, {name}, round {round_ + 1}: {got[-1]:.2f} img/s ({result.encoded} encoded; "
                    f"{result.decode}; encoder waited {result.wait_seconds} s, encoded {result.encode_seconds} s)")
        finally:
            end_kept()
        figure = statistics.median(got[1:] or got)  # the first round pays for starting the decode processes
        out["splits"][name] = {"decode": described, "rounds": [round(r, 2) for r in got], "img_s": round(figure, 2),
                               "encode_core_ms": round(encode_s * 1e3, 1), "encode_threads": threads,
                               "bound": round(bound, 2), "of_bound": round(figure / bound, 2)}
    return out


def forget(spec) -> None:
    """The model's loaded and compiled encoders out of this process before the next model loads."""
    from imgest import encoders

    with encoders._lock:
        for key in [k for k in encoders._loaded if k[0] == spec.model_id]:
            del encoders._loaded[key]
    gc.collect()


def fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def report(kind: str, spec, rows: dict, gates: dict, decode: dict, lite0: dict, e2e: dict | None) -> None:
    cores = os.cpu_count() or 1
    side = decode["decode_side"]
    flag = "" if side == EXPECTED_SIDE[kind] else f" (expected {EXPECTED_SIDE[kind]}: NOT AS EXPECTED)"
    print(f"\n## {LABELS[kind]}: {spec.dim}-d, decode side {side}{flag}\n")
    print(f"| runtime | precision | img/s, 1 thread | img/s, {cores} threads | x torch fp32 ({cores} threads) | "
          "min cosine | mean | 1st percentile | overlap@10 | gate |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    base = rows.get("torch fp32", (None, {}))[1].get(cores)
    for label in ("torch fp32", "openvino fp32", "openvino bf16"):
        runtime, precision = label.split()
        rates = rows.get(label, (None, {}))[1]
        g = gates.get(label, {"verdict": "reference" if label == "torch fp32" else "-"})
        verdict = g["verdict"].split(":")[0] if len(g["verdict"]) > 60 else g["verdict"]
        ratio = rates[cores] / base if rates.get(cores) and base else None
        print(f"| {runtime} | {precision} | {fmt(rates.get(1))} | {fmt(rates.get(cores))} | {fmt(ratio)} | "
              f"{fmt(g.get('min_cosine'), 6)} | {fmt(g.get('mean_cosine'), 6)} | {fmt(g.get('p1_cosine'), 6)} | "
              f"{fmt(g.get('overlap'), 3)} | {verdict} |")
    for label, g in gates.items():
        if not g["verdict"].startswith("passes"):
            print(f"\n{label}: {g['verdict']}")
    print(f"\nDecode + preprocess, core-ms a photo (one thread, the better of two rounds; {LABELS['lite0']} at side "
          f"{lite0['decode_side']} on the same photos):\n")
    print("| photos | full | reduced (simplejpeg) | full / reduced | reduced, Lite0 | reduced / Lite0's |")
    print("|---|---:|---:|---:|---:|---:|")
    for part, name in (("all", "all (a tenth PNG cut-outs)"), ("jpeg", "JPEGs alone")):
        full, reduced, lite = (decode[f"full_{part}_ms"], decode[f"reduced_{part}_ms"], lite0[f"reduced_{part}_ms"])
        print(f"| {name} | {full:.2f} | {reduced:.2f} | {full / reduced:.2f} | {lite:.2f} | {reduced / lite:.2f} |")
    ratio = decode["reduced_all_ms"] / lite0["reduced_all_ms"]
    print(f"\nreduced decode against Lite0's: {ratio:.2f}x ({'within' if ratio <= 1.5 else 'NOT within'} 1.5x)")
    if e2e:
        print(f"\nPipeline (encode_shard on the photos, {e2e['runtime']} at batch {e2e['batch']}, {DECODER}; decode "
              f"{e2e['decode_core_ms']:.2f} core-ms a photo as the run measures it: read, hash, decode, preprocess; "
              "work bound = cores / (decode + encode core-seconds per image), encode at the pipeline's threads):\n")
        print("| split | decode workers, encoder threads | img/s (rounds after the first) | rounds | "
              "encode core-ms/img | work bound img/s | of the bound |")
        print("|---|---|---:|---|---:|---:|---:|")
        for name, r in e2e["splits"].items():
            print(f"| {name} | {r['decode']} | {r['img_s']:.2f} | {', '.join(f'{x:.2f}' for x in r['rounds'])} | "
                  f"{r['encode_core_ms']:.1f} | {r['bound']:.2f} | {r['of_bound']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/imgest-hf-bench",
                        help="models, compiled cache, catalogue and stores (its folders are made anew each run)")
    parser.add_argument("--models", default=",".join(KINDS), help=f"comma list of {', '.join(KINDS)}")
    parser.add_argument("--photos", type=int, default=64, help="photos for the decode figures")
    parser.add_argument("--pipeline-photos", type=int, default=128, help="photos for the pipeline (0: skip it)")
    parser.add_argument("--rounds", type=int, default=2, help="pipeline shards per model and split")
    parser.add_argument("--batch", type=int, default=4, help="batch of the bare model and the pipeline")
    parser.add_argument("--seconds", type=float, default=3.0, help="per bare-model measurement")
    args = parser.parse_args()
    kinds = [k.strip() for k in args.models.split(",") if k.strip()]
    if unknown := set(kinds) - set(KINDS):
        parser.error(f"--models: unknown {', '.join(sorted(unknown))}; known: {', '.join(KINDS)}")

    work = os.path.abspath(args.workdir)
    for sub in ("models", "compiled", "catalogue", "stores"):
        shutil.rmtree(os.path.join(work, sub), ignore_errors=True)
    os.makedirs(os.path.join(work, "models"), exist_ok=True)
    # the model folders are allowed as an operator allows theirs; a fresh compiled cache: every figure measured
    os.environ["IMGEST_MODEL_DIRS"] = os.pathsep.join(
        [os.path.join(work, "models"), *filter(None, os.environ.get("IMGEST_MODEL_DIRS", "").split(os.pathsep))])
    os.environ["IMGEST_COMPILED_CACHE"] = os.path.join(work, "compiled")

    import openvino
    import torch
    import transformers

    from imgest import encoders
    from imgest.encoders.base import _cpu_model
    from imgest.encoders.precision import native_precisions
    from imgest.images.demo import product_photos
    from imgest.storage import Location
    from imgest.tasks.ingest.plan import WorkItem

    cores = os.cpu_count() or 1
    print(f"# Transformers models at their real size ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    print(f"{_cpu_model()}, {cores} cores, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}; torch "
          f"{torch.__version__}, transformers {transformers.__version__}, openvino {openvino.get_version()}; "
          f"native precisions: {', '.join(native_precisions('cpu'))}", flush=True)

    photos = product_photos(max(args.photos, args.pipeline_photos), seed=1, sides=(1100, 1300))
    decode_set = dict(list(photos.items())[:args.photos])
    sizes = [len(b) for b in decode_set.values()]
    say(f"{len(photos)} product photos 1100-1300 px wide; the decode figures on the first {len(decode_set)} "
        f"({sum(k.endswith('.png') for k in decode_set)} PNG cut-outs, {np.mean(sizes) / 1e3:.0f} kB mean)")
    cat = Location(os.path.join(work, "catalogue"))
    pipeline_set = dict(list(photos.items())[:args.pipeline_photos])
    for key, data in pipeline_set.items():
        cat.write_bytes(key, data)
    items = tuple(WorkItem(k, cat.uri(k), len(b), None, None, None) for k, b in pipeline_set.items())

    lite0_encoder = encoders.load(encoders.resolve(LITE0), "cpu")
    lite0 = decode_figures(lite0_encoder, decode_set)
    say(f"Lite0 (decode side {lite0['decode_side']}): full {lite0['full_all_ms']:.2f}, reduced "
        f"{lite0['reduced_all_ms']:.2f} core-ms a photo")
    del lite0_encoder
    forget(encoders.resolve(LITE0))

    results = {}
    for kind in kinds:
        folder = os.path.join(work, "models", kind)
        say(f"{LABELS[kind]}: building with random weights in {folder}")
        build(kind, folder)
        spec = encoders.resolve(f"hf:{folder}")
        encoders.recorded(spec.name, None, "bench")  # the folder is allowed, as a store's records would need
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        say(f"{LABELS[kind]}: {spec.dim}-d, {size / 1e6:.0f} MB on disk")
        rows, gates = bare(spec, args)
        plain = rows["torch fp32"][0]
        decode = decode_figures(plain, decode_set)
        say(f"{LABELS[kind]}: decode side {decode['decode_side']}; full {decode['full_all_ms']:.2f}, reduced "
            f"{decode['reduced_all_ms']:.2f} core-ms a photo")
        e2e = pipeline(spec, rows, args, work, cat, items) if args.pipeline_photos else None
        report(kind, spec, rows, gates, decode, lite0, e2e)
        results[kind] = {"dim": spec.dim, "bare": {k: {str(t): round(r, 2) for t, r in v[1].items()}
                                                  for k, v in rows.items()},
                         "gates": gates, "decode": decode, "pipeline": e2e}
        del rows, plain
        forget(spec)

    default, alone = (name for name, _ in SPLITS)
    print(f"\n## Summary ({cores} cores; bare img/s on {cores} threads; decode core-ms a photo, reduced; the "
          "pipeline as a run splits the cores, and with --decode-workers 1)\n")
    print("| model | decode side | torch fp32 | openvino fp32 | openvino bf16 | bf16 gate | reduced decode | "
          "x Lite0's | pipeline with | img/s | work bound | of the bound | img/s, --decode-workers 1 | of its bound |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|")
    print(f"| {LABELS['lite0']} | {lite0['decode_side']} | | | | | {lite0['reduced_all_ms']:.2f} | 1.00 | | | | | | |")
    for kind, r in results.items():
        bare_ = {k: v.get(str(cores)) for k, v in r["bare"].items()}
        gate = r["gates"].get("openvino bf16", {}).get("verdict", "-").split(":")[0]
        e2e = r["pipeline"] or {"splits": {}}
        one, two = e2e["splits"].get(default, {}), e2e["splits"].get(alone, {})
        print(f"| {LABELS[kind]} | {r['decode']['decode_side']} | {fmt(bare_.get('torch fp32'))} | "
              f"{fmt(bare_.get('openvino fp32'))} | {fmt(bare_.get('openvino bf16'))} | {gate} | "
              f"{r['decode']['reduced_all_ms']:.2f} | {r['decode']['reduced_all_ms'] / lite0['reduced_all_ms']:.2f} | "
              f"{e2e.get('runtime', '-')} | {fmt(one.get('img_s'))} | {fmt(one.get('bound'))} | "
              f"{fmt(one.get('of_bound'))} | {fmt(two.get('img_s'))} | {fmt(two.get('of_bound'))} |")
    with open(os.path.join(work, "results.json"), "w") as fh:
        json.dump({"lite0": lite0, **results}, fh, indent=1, default=str)
    say(f"done; load {' '.join(f'{x:.2f}' for x in os.getloadavg())}; figures in {work}/results.json")


if __name__ == "__main__":
    main()
