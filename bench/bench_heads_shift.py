"""Heads across a real style shift: the same 1,911 emoji drawn by two artists (Google's Noto and Twitter's
Twemoji, from the npm packages emoji-datasource-google / -twitter 16.0.0). The catalogue is Google's artwork,
rendered as product-sized JPEGs (64 px artwork scaled to 50-75% of an 800-1400 px white canvas); the
queries are Twitter's drawings of the same items, rendered the same way and never in the catalogue. Items are
split in half (seeded): `dev` queries may select epochs (`--eval-queries`), `test` queries measure, and only
test figures are reported as results.

    npm pack emoji-datasource-google@16.0.0 emoji-datasource-twitter@16.0.0   # in --emoji-dir
    OPENBLAS_CORETYPE=Haswell .venv/bin/python bench/bench_heads_shift.py --emoji-dir /tmp/emoji

For the base model and each head: recall@1/5/10 of the test queries against the whole catalogue (exact
search), the paired bootstrap interval of head - base, the training report's own validation figure beside it
(what train-head would have told the user), and the training time. Label-free heads train on the catalogue
alone; labelled heads also see the Twitter drawings of the dev items (a second store), labelled by item.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np

from imgest.config import IngestConfig, TrainHeadConfig
from imgest.config.flow_params import gather_flat

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
VENDORS = ("google", "twitter")


def artwork(emoji_dir: str) -> tuple[list[dict], dict[str, tarfile.TarFile]]:
    archives = {}
    for vendor in VENDORS:
        path = os.path.join(emoji_dir, f"emoji-datasource-{vendor}-16.0.0.tgz")
        if not os.path.exists(path):
            subprocess.run(["npm", "pack", f"emoji-datasource-{vendor}@16.0.0"], cwd=emoji_dir, check=True)
        archives[vendor] = tarfile.open(path)
    entries = json.load(archives["google"].extractfile("package/emoji.json"))
    return [e for e in entries if all(e.get(f"has_img_{v}") for v in VENDORS)], archives


def render(png: bytes, rng) -> bytes:
    """64 px artwork as a product photo: scaled up, placed on a white canvas, JPEG."""
    from PIL import Image

    art = Image.open(io.BytesIO(png)).convert("RGBA")
    side = int(rng.integers(800, 1400))
    size = int(side * rng.uniform(0.5, 0.75))
    art = art.resize((size, size), Image.Resampling.LANCZOS)
    canvas = Image.new("RGB", (side, side), (255, 255, 255))
    offset = (int(rng.integers(0, side - size + 1)), int(rng.integers(0, side - size + 1)))
    canvas.paste(art, offset, art)
    out = io.BytesIO()
    canvas.save(out, "JPEG", quality=90)
    return out.getvalue()


def build(work: str, emoji_dir: str, seed: int = 0) -> dict:
    entries, archives = artwork(emoji_dir)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(entries))
    dev = {entries[i]["image"] for i in order[: len(entries) // 2]}
    paths = {"catalogue": os.path.join(work, "catalogue"), "labelled": os.path.join(work, "catalogue-labelled"),
             "queries": os.path.join(work, "queries")}
    for p in paths.values():
        os.makedirs(p, exist_ok=True)
    sets = {"dev": [], "test": []}
    labels = ["item_id,label"]
    for n, e in enumerate(entries):
        name, stem = e["image"], e["image"].removesuffix(".png")
        item = f"emoji/{stem}.jpg"
        google = render(archives["google"].extractfile(f"package/img/google/64/{name}").read(), rng)
        twitter = render(archives["twitter"].extractfile(f"package/img/twitter/64/{name}").read(), rng)
        for folder in (paths["catalogue"], paths["labelled"]):
            os.makedirs(os.path.join(folder, "emoji"), exist_ok=True)
            with open(os.path.join(folder, item), "wb") as fh:
                fh.write(google)
        with open(os.path.join(paths["queries"], f"{stem}.jpg"), "wb") as fh:
            fh.write(twitter)
        split = "dev" if name in dev else "test"
        sets[split].append({"query_id": stem, "image": os.path.join(paths["queries"], f"{stem}.jpg"),
                            "relevant": [item], "class": e["category"]})
        if split == "dev":  # the labelled store also holds the dev items' Twitter drawings, labelled by item
            os.makedirs(os.path.join(paths["labelled"], "twitter"), exist_ok=True)
            with open(os.path.join(paths["labelled"], "twitter", f"{stem}.jpg"), "wb") as fh:
                fh.write(twitter)
            labels += [f"{item},{stem}", f"twitter/{stem}.jpg,{stem}"]
        if n % 500 == 0:
            print(f"rendered {n}/{len(entries)}", flush=True)
    for split, queries in sets.items():
        with open(os.path.join(work, f"{split}.jsonl"), "w") as fh:
            fh.writelines(json.dumps(q) + "\n" for q in queries)
    with open(os.path.join(work, "labels.csv"), "w") as fh:
        fh.write("\n".join(labels) + "\n")
    return {"items": len(entries), "dev": len(sets["dev"]), "test": len(sets["test"])}


VARIANTS = [  # (name, train-head parameters); label-free unless labels
    ("label-free, as before (MLP 256-d, crop/flip/colour, no keep term, random batches), infonce",
     {"head_type": "mlp", "dim_out": 256, "augment": "crop,flip,colour", "keep": 0.0, "hard_negatives": 0}),
    ("label-free, as before, triplet",
     {"head_type": "mlp", "dim_out": 256, "augment": "crop,flip,colour", "keep": 0.0, "hard_negatives": 0,
      "loss": "triplet"}),
    ("label-free, residual + all augmentations + keep + hard negatives, infonce", {}),
    ("label-free, residual ..., triplet", {"loss": "triplet"}),
    ("label-free, residual ..., infonce, epochs selected on the dev queries", {"eval_queries": "dev"}),
    ("ablation: without geometry", {"augment": "photometry,rendering"}),
    ("ablation: without photometry", {"augment": "geometry,rendering"}),
    ("ablation: without rendering", {"augment": "geometry,photometry"}),
    ("ablation: without the keep term", {"keep": 0.0}),
    ("ablation: without hard negatives", {"hard_negatives": 0}),
    ("labelled (dev items' two drawings), residual, infonce", {"labels": True, "split": "labels"}),
    ("labelled, residual, triplet", {"labels": True, "loss": "triplet", "split": "labels"}),
    ("labelled, residual, proxynca", {"labels": True, "loss": "proxynca", "split": "labels"}),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--emoji-dir", required=True)
    parser.add_argument("--workdir")
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--only", help="comma list of variant numbers (1-based) to run")
    args = parser.parse_args()

    from prefect.testing.utilities import prefect_test_harness

    from imgest.encoders.head import load_module, project
    from imgest.flows.ingest import ingest
    from imgest.flows.train_head import train_head_flow
    from imgest.state.live import load_live_vectors
    from imgest.state.models import find_model
    from imgest.storage import Location
    from imgest.tasks.heads.evaluate import query_scorer

    work = args.workdir or tempfile.mkdtemp(prefix="imgest-heads-shift-")
    if not os.path.exists(os.path.join(work, "test.jsonl")):
        print(build(work, args.emoji_dir))
    print(f"# heads across a style shift ({time.strftime('%Y-%m-%d %H:%M')} UTC), {os.cpu_count()} cores, "
          f"work {work}\n", flush=True)
    stores = {"free": os.path.join(work, "store"), "labelled": os.path.join(work, "store-labelled")}
    with prefect_test_harness(server_startup_timeout=90):
        for key, cat in (("free", "catalogue"), ("labelled", "catalogue-labelled")):
            t0 = time.perf_counter()
            run = ingest(IngestConfig(catalogue=os.path.join(work, cat), store=stores[key], batch_size="32"))
            print(f"{key} store: {run['listed']} images, {run['encoded']} encoded in "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
        loc = Location(stores["free"])
        base = find_model(loc, "efficientnet-lite0")
        live = load_live_vectors(loc, base["slug"], int(base["dim"]))
        test = query_scorer(os.path.join(work, "test.jsonl"), live, base["name"])
        print(f"test: {len(test.query_ids)} Twitter queries against {len(live)} Google items "
              f"(base {base['model_id']})\n", flush=True)
        rows = [("base model", test.score(None), None, "-", "-")]
        print("base", json.dumps(rows[0][1]), flush=True)
        chosen = {int(n) for n in args.only.split(",")} if args.only else set(range(1, len(VARIANTS) + 1))
        for number, (name, params) in enumerate(VARIANTS, 1):
            if number not in chosen:
                continue
            params = dict(params)
            labelled = params.pop("labels", False)
            if params.get("eval_queries"):
                params["eval_queries"] = os.path.join(work, f"{params['eval_queries']}.jsonl")
            t0 = time.perf_counter()
            flat = {"store": stores["labelled" if labelled else "free"], "base_model": base["name"],
                    "labels": os.path.join(work, "labels.csv") if labelled else None, **params, "epochs": args.epochs}
            config = TrainHeadConfig.model_validate(gather_flat(TrainHeadConfig, flat)[0]["config"])
            trained = train_head_flow(config)
            seconds = time.perf_counter() - t0
            module = load_module(trained["folder"], trained["config"])
            report = test.report(lambda v, m=module: project(m, v), seed=0)
            v = trained["config"]["validation"]
            own = f"{v['recall@1']} vs base {v['base_recall@1']}" + (" (proxy)" if v["proxy"] else "") + \
                (f"; dev r@1 {v['eval']['head']['recall@1']} vs {v['eval']['base']['recall@1']}" if v["eval"] else "")
            rows.append((name, report["head"], report["bootstrap"], own, f"{seconds:.0f} (epoch {v['best_epoch']})"))
            print(time.strftime("%H:%M:%S"), number, name, json.dumps(report["head"]),
                  {k: [round(b["low"], 4), round(b["high"], 4)] for k, b in report["bootstrap"].items()}, own,
                  flush=True)
    print("\n| head | test r@1 | r@5 | r@10 | r@1 - base [95% CI] | r@10 - base [95% CI] | training report's "
          "validation r@1 | train s (best epoch) |")
    print("|---|---:|---:|---:|---|---|---|---|")
    def ci(boot, metric):
        return "-" if boot is None else (f"{boot[metric]['difference']:+.3f} [{boot[metric]['low']:+.3f}, "
                                         f"{boot[metric]['high']:+.3f}]")

    for name, hits, boot, own, seconds in rows:
        print(f"| {name} | {hits['recall@1']:.3f} | {hits['recall@5']:.3f} | {hits['recall@10']:.3f} | "
              f"{ci(boot, 'recall@1')} | {ci(boot, 'recall@10')} | {own} | {seconds} |")


if __name__ == "__main__":
    main()
