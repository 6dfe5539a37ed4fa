"""Label-free descriptors by backbone and scale across two real shifts: average, GeM and multi-scale GeM pooling of
EfficientNet-Lite0, Lite1 and Lite2, each without and with pair whitening (train-head --whiten's default), and
each model's encode cost per image, measured in one run.

    npm pack emoji-datasource-google@16.0.0 emoji-datasource-twitter@16.0.0   # in --emoji-dir
    OPENBLAS_CORETYPE=Haswell .venv/bin/python bench/bench_backbones.py --emoji-dir /tmp/emoji

The sets are bench_descriptors.py's (emoji: a style shift; products: a shot shift), their queries split in half
(seeded): the dev half is where the best descriptor is chosen, the test half is what is reported. Every model runs
through OpenVINO fp32 (the CPU default), exact search. Each image is decoded once per backbone, at the side its
multi-scale variant needs, and preprocessed for each of the three models; each pair whitening is fitted on its
own model's vectors of 1,000 catalogue images and 3 augmented views of each (no labels, no queries). Intervals:
paired bootstrap (1,000 resamples) against Lite0 GeM + pair whitening on the same test queries. Encode cost: decode
+ preprocess + encode of 64 of the set's catalogue photos in batches of 32, one process, the better of two rounds,
measured after the recall (nothing else of this benchmark running).

With --scale-sets it measures instead which scales pay: Lite0's GeM at six sides (158-316 px, each the 316 px crop
resized as the -gem-ms graph resizes it), every set of them tried summed, without and with PCA whitening
(shrinkage 0.5, fitted on the catalogue's vectors), on both sets.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

BACKBONES = {"Lite0": "efficientnet-lite0", "Lite1": "efficientnet-lite1", "Lite2": "efficientnet-lite2"}
POOLINGS = {"average": "", "GeM": "-gem", "GeM multi-scale": "-gem-ms"}
WHITENED = " + pair whitening"
REFERENCE = "Lite0 GeM" + WHITENED
PAIR_IMAGES, VIEWS, SHRINKAGE = 1000, 3, 0.5  # train-head --whiten's defaults
BATCH = 32


def load(name: str):
    from imgest import encoders

    return encoders.load(encoders.resolve(name), "cpu", "openvino", "fp32")


def encode_backbone(names: list[str], jpegs: list[bytes], paired: np.ndarray) -> dict[str, tuple]:
    """name -> (the catalogue's or queries' vectors, the views' vectors of the `paired` rows, VIEWS each, item-major):
    each image decoded once, at the largest side any of `names` needs."""
    from imgest.images.decode import decode_image
    from imgest.tasks.heads.views import WORK_SIDE, augment, view_rng

    models = {name: load(name) for name in names}
    side = max(m.decode_side for m in models.values())
    vectors = {name: [] for name in names}
    for begin in range(0, len(jpegs), BATCH):
        images = [decode_image(d, min_side=side) for d in jpegs[begin:begin + BATCH]]
        for name, model in models.items():
            vectors[name].append(model.encode_images(np.stack([model.preprocess(i) for i in images])))
    views = {name: [] for name in names}
    for begin in range(0, len(paired), BATCH):
        shots = []
        for row in paired[begin:begin + BATCH]:  # as train-head makes its views (bench_descriptors.views_of)
            image = decode_image(jpegs[row], min_side=WORK_SIDE // 2)
            image.thumbnail((WORK_SIDE, WORK_SIDE))
            shots += [augment(image, view_rng(0, int(row), v)) for v in range(VIEWS)]
        for name, model in models.items():
            views[name].append(model.encode_images(np.stack([model.preprocess(s) for s in shots])))
    return {name: (np.concatenate(vectors[name]), np.concatenate(views[name]) if len(paired) else None)
            for name in names}


def measure(title: str, catalogue_jpegs: list[bytes], query_jpegs: list[bytes], asked: np.ndarray) -> dict:
    from bench_descriptors import recall

    from imgest.retrieval.metrics import paired_bootstrap
    from imgest.tasks.heads.whiten import fit_pair_whitening

    paired = np.sort(np.random.default_rng(2).choice(len(catalogue_jpegs), size=min(PAIR_IMAGES, len(catalogue_jpegs)),
                                                     replace=False))
    runs = {}
    for backbone, base in BACKBONES.items():
        names = {f"{backbone} {pooling}": base + suffix for pooling, suffix in POOLINGS.items()}
        catalogue = encode_backbone(list(names.values()), catalogue_jpegs, paired)
        queries = encode_backbone(list(names.values()), query_jpegs, np.zeros(0, int))
        for label, name in names.items():
            vectors, shots = catalogue[name]
            runs[label] = (vectors, queries[name][0], name)
            fitted = fit_pair_whitening(vectors, np.repeat(vectors[paired], VIEWS, axis=0), shots, 0, SHRINKAGE)
            runs[label + WHITENED] = (fitted.apply(vectors), fitted.apply(queries[name][0]), name)
        print(f"  embedded: {title}, {backbone}", flush=True)
    half = {"dev": np.arange(len(asked) // 2), "test": np.arange(len(asked) // 2, len(asked))}
    reference = runs[REFERENCE]
    print(f"\n{title}: {len(catalogue_jpegs)} catalogue items; {len(half['test'])} test queries "
          f"({len(half['dev'])} more as dev); OpenVINO fp32; exact search\n")
    print(f"| descriptor | dev R@1 | test R@1 | test R@10 | R@1 - {REFERENCE}, 95% CI | R@10 - {REFERENCE}, 95% CI |")
    print("|---|---:|---:|---:|---|---|")
    table = {}
    for label, (catalogue, queries, name) in runs.items():
        figures = {}
        for part, rows in half.items():
            for k in (1, 10):
                figures[part, k] = recall(queries[rows], catalogue, asked[rows], k)
        against = {k: recall(reference[1][half["test"]], reference[0], asked[half["test"]], k) for k in (1, 10)}
        ci = {k: paired_bootstrap(against[k], figures["test", k]) for k in (1, 10)}
        table[label] = {"dev": figures["dev", 1].mean(), "test": figures["test", 1].mean(), "ci": ci, "name": name}
        print(f"| {label} | {figures['dev', 1].mean():.3f} | {figures['test', 1].mean():.3f} | "
              f"{figures['test', 10].mean():.3f} | "
              + (" | ".join(f"{ci[k]['difference']:+.3f} [{ci[k]['low']:+.3f}, {ci[k]['high']:+.3f}]" for k in (1, 10))
                 if label != REFERENCE else "(the reference) | ")
              + " |", flush=True)
    return table


def encode_cost(name: str, jpegs: list[bytes]) -> float:
    """ms per image: decode + preprocess + encode, batches of BATCH, one process, the better of two rounds."""
    from imgest.images.decode import decode_image

    model = load(name)
    model.encode_images(np.stack([model.preprocess(decode_image(d, min_side=model.decode_side))
                                  for d in jpegs[:2]]))  # warm-up: the first call's allocations
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        for begin in range(0, len(jpegs), BATCH):
            model.encode_images(np.stack([model.preprocess(decode_image(d, min_side=model.decode_side))
                                          for d in jpegs[begin:begin + BATCH]]))
        best = min(best, time.perf_counter() - start)
    return best * 1000 / len(jpegs)


SIDES = (158, 192, 224, 256, 288, 316)  # Lite0's side over sqrt 2 to times sqrt 2
SCALE_SETS = ((224,), (256,), (288,), (316,), (158, 224), (192, 224), (224, 256), (224, 288), (224, 316),
              (158, 224, 316), (192, 224, 256), (192, 224, 288), (224, 256, 288), (224, 256, 316), (224, 288, 316),
              SIDES)


def gem_by_side(jpegs: list[bytes]) -> dict[int, np.ndarray]:
    """Lite0's normalised GeM descriptor of each image at each of SIDES, from its largest crop as -gem-ms makes it."""
    import torch
    import torch.nn.functional as F

    from imgest import encoders
    from imgest.encoders.efficientnet import GEM, gem
    from imgest.images.decode import decode_image

    model = encoders.load(encoders.resolve("efficientnet-lite0-gem-ms"), "cpu")  # its torch module, preprocessing
    out = {side: [] for side in SIDES}
    for begin in range(0, len(jpegs), BATCH):
        largest = torch.from_numpy(np.stack([model.preprocess(decode_image(d, min_side=model.decode_side))
                                             for d in jpegs[begin:begin + BATCH]])).float()
        with torch.inference_mode():
            for side in SIDES:
                scaled = largest if side == max(SIDES) else F.interpolate(
                    largest, size=(side, side), mode="bicubic", antialias=True, align_corners=False).clamp(0, 255)
                pooled = gem(model.model.extract_features((scaled - 127.0) / 128.0), GEM["gem_p"])
                out[side].append(F.normalize(pooled, dim=1).numpy())
    return {side: np.concatenate(parts) for side, parts in out.items()}


def scale_sets(sets: dict) -> None:
    from bench_descriptors import recall

    from imgest.tasks.heads.whiten import fit_whitening

    def summed(by_side, sides):
        total = sum(by_side[side] for side in sides)
        return total / np.linalg.norm(total, axis=1, keepdims=True)

    dev = {}
    for title, (catalogue_jpegs, query_jpegs, asked) in sets.items():
        catalogue, queries = gem_by_side(catalogue_jpegs), gem_by_side(query_jpegs)
        half = {"dev": np.arange(len(asked) // 2), "test": np.arange(len(asked) // 2, len(asked))}
        print(f"\n{title}: {len(catalogue_jpegs)} catalogue items, {len(asked)} queries (half dev, half test)\n")
        print("| sides (px) | dev R@1 | test R@1 | test R@10 | whitened dev R@1 | whitened test R@1 | "
              "whitened test R@10 |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for sides in SCALE_SETS:
            c, q = summed(catalogue, sides), summed(queries, sides)
            white = fit_whitening(c, 0, 0.5)
            wc, wq = white.apply(c), white.apply(q)
            cells = [recall(a[half[part]], b, asked[half[part]], k).mean()
                     for a, b in ((q, c), (wq, wc)) for part, k in (("dev", 1), ("test", 1), ("test", 10))]
            dev.setdefault(sides, []).append((cells[0], cells[3]))
            print(f"| {', '.join(map(str, sides))} | " + " | ".join(f"{x:.3f}" for x in cells) + " |", flush=True)
    print("\nDev recall@1 averaged over the sets, plain / whitened:\n")
    for sides, figures in dev.items():
        print(f"- {', '.join(map(str, sides))}: {np.mean([f[0] for f in figures]):.3f} / "
              f"{np.mean([f[1] for f in figures]):.3f}")


def main() -> None:
    from bench_descriptors import emoji_set, products_set

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--emoji-dir", required=True)
    parser.add_argument("--emoji", type=int, default=1911, help="emoji catalogue items")
    parser.add_argument("--products", type=int, default=5000, help="products catalogue items")
    parser.add_argument("--queries", type=int, default=800, help="queries asked per set (half dev, half test)")
    parser.add_argument("--scale-sets", action="store_true", help="which scales pay (Lite0), instead")
    args = parser.parse_args()
    os.environ.setdefault("IMGEST_COMPILED_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "imgest",
                                                                "compiled"))
    print(f"# Descriptors by backbone and scale ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{os.cpu_count()} cores)")
    sets = {"emoji": emoji_set(args.emoji_dir, args.emoji, args.queries),
            "products": products_set(args.products, args.queries)}
    if args.scale_sets:
        return scale_sets(sets)
    tables = {"emoji": measure("Emoji, Google's drawings against Twitter's", *sets["emoji"]),
              "products": measure("Products, packshots against photos", *sets["products"])}
    print("\nDev recall@1 averaged over the two sets (where the best is chosen), then test:\n")
    dev = {label: np.mean([t[label]["dev"] for t in tables.values()]) for label in tables["emoji"]}
    for label in dev:
        print(f"- {label}: dev {dev[label]:.3f}, test {np.mean([t[label]['test'] for t in tables.values()]):.3f}")
    best = max((label for label in dev if label != REFERENCE), key=dev.get)
    print(f"\nBest on dev: {best}; on the test halves against {REFERENCE}:")
    for title, table in tables.items():
        ci = table[best]["ci"][1]
        print(f"- {title}: recall@1 {ci['difference']:+.3f} [{ci['low']:+.3f}, {ci['high']:+.3f}]")
    photos = sets["products"][0][:64]
    print(f"\nEncode cost, ms per image on {os.cpu_count()} cores (64 product packshots, OpenVINO fp32):\n")
    for backbone, base in BACKBONES.items():
        for pooling, suffix in POOLINGS.items():
            print(f"- {backbone} {pooling} ({base + suffix}): {encode_cost(base + suffix, photos):.1f}", flush=True)


if __name__ == "__main__":
    main()
