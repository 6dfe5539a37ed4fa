"""Caption retriever against image retriever, and their fusions, per query class (issue 13).

    OPENBLAS_CORETYPE=Haswell .venv/bin/python bench/bench_captions.py [--per-class 100] [--queries 10]

Catalogue: `--per-class` Fashion-MNIST *train* images per class (PNG), each its own product, with metadata
from `imgest.images.demo.product_metadata` (title: colour, material, detail; caption; category; price). Two
retrievers over it: `captions` = minilm-l6 over the titles and captions, `serving` = efficientnet-lite0 over
the pixels (real weights, both offline).

Queries are blind: their photos are Fashion-MNIST *test* images, never in the catalogue, and their words
are a shopper's, not copied from the titles. Each carries a photo and words; the caption retriever reads
the words, the image retriever the photo (one judged query, two retrievers). Two classes:
  - category: "sweater", "boots", ... with a test photo of that class; relevant: every catalogue item of it;
  - colour: "navy sweater", ... with a test photo of that class; relevant: the class's items whose title has
    that colour.
The colour lives only in the metadata (Fashion-MNIST is grey): the image retriever cannot answer the colour
class by construction. The category class is where the two really compete. This is a constructed set,
not a product catalogue's query log: read the figures as a demonstration of the method, not as a claim
about either model on real traffic.

Reported (the eval code path of `imgest eval --compare`): recall@k per class for caption, image, RRF,
calibrated fusion (Platt, cross-fitted) and max-score; win/loss cells; the paired bootstrap of image -
caption; the routing table with its intervals; and the traffic-weighted gain for an assumed traffic mix.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

from imgest.config import IndexConfig, IngestConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORDS = {"t-shirt": "t-shirt", "trouser": "trousers", "pullover": "sweater", "dress": "dress", "coat": "jacket",
         "sandal": "sandals", "shirt": "shirt", "sneaker": "sneakers", "bag": "handbag", "ankle-boot": "boots"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-class", type=int, default=100)
    parser.add_argument("--queries", type=int, default=10, help="queries per class and query class")
    parser.add_argument("--resamples", type=int, default=1000)
    parser.add_argument("--k", type=int, default=1, help="the cut-off: recall@k here is 'a relevant item in the "
                                                         "top k' (imgest's recall@K), so k=1 is the discriminating "
                                                         "one when a class has 100 relevant items")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="imgest-bench-captions-")
    os.environ.setdefault("PREFECT_HOME", os.path.join(root, "prefect-home"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

    from PIL import Image

    from imgest.flows.build_index import build_index
    from imgest.flows.ingest import ingest
    from imgest.images.demo import FASHION_CLASSES, product_metadata, read_fashion_mnist
    from imgest.retrieval.querysets import LabelledQuery
    from imgest.retrieval.routing import traffic_gain
    from imgest.tasks.evaluate.retrievers import run_evaluation

    rng = np.random.default_rng(0)
    train, train_labels = read_fashion_mnist("train")
    test, test_labels = read_fashion_mnist("t10k")
    cat, store = os.path.join(root, "catalogue"), os.path.join(root, "store")
    labels = {}
    for c, cls in enumerate(FASHION_CLASSES):
        os.makedirs(os.path.join(cat, cls), exist_ok=True)
        for i in rng.choice(np.flatnonzero(train_labels == c), args.per_class, replace=False):
            key = f"{cls}/{i:05d}.png"
            Image.fromarray(train[i]).save(os.path.join(cat, key))
            labels[key] = c
    rows = product_metadata(labels, images_per_product=1)
    with open(os.path.join(root, "metadata.jsonl"), "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)

    t0 = time.perf_counter()
    ingest(IngestConfig(catalogue=cat, store=store, model="efficientnet-lite0", metadata=os.path.join(root,
                                                                                                      "metadata.jsonl")))
    build_index(IndexConfig(store=store, model="efficientnet-lite0", alias="serving"))
    ingest(IngestConfig(catalogue=cat, store=store, model="minilm-l6"))
    build_index(IndexConfig(store=store, model="minilm-l6", alias="captions"))
    print(f"catalogue: {len(labels)} items ({args.per_class} per class); both retrievers ingested and indexed "
          f"in {time.perf_counter() - t0:.0f} s")

    queries, qdir = [], os.path.join(root, "queries")
    os.makedirs(qdir)
    for c, cls in enumerate(FASHION_CLASSES):
        photos = rng.choice(np.flatnonzero(test_labels == c), 2 * args.queries, replace=False)
        for n, i in enumerate(photos):
            path = os.path.join(qdir, f"{cls}-{i:05d}.png")
            Image.fromarray(test[i]).save(path)
            if n < args.queries:
                relevant = [r["item_id"] for r in rows if r["category"] == cls]
                queries.append(LabelledQuery(f"category-{cls}-{n}", relevant, path, WORDS[cls], "category"))
                continue
            colours = sorted({r["title"].split()[0] for r in rows if r["category"] == cls})
            colour = colours[(n - args.queries) % len(colours)]
            relevant = [r["item_id"] for r in rows if r["category"] == cls and r["title"].startswith(colour + " ")]
            queries.append(LabelledQuery(f"colour-{cls}-{n}", relevant, path, f"{colour} {WORDS[cls]}", "colour"))
    report = run_evaluation(store, queries, alias="captions", compare_to="serving", ks=[args.k],
                            resamples=args.resamples)
    comp, metric = report["compare"], f"recall@{args.k}"
    print(f"\n{len(queries)} blind queries ({args.queries} per class and query class); {metric}; "
          f"A = captions ({report['a']['model_id']}), B = serving ({report['b']['model_id']})\n")
    print(f"{'query class':12s} {'n':>4s} {'captions':>9s} {'image':>9s} {'rrf':>9s} {'calibrated':>11s} "
          f"{'route':>11s} {'route - captions [95% CI]':>28s}")
    for cls, entry in comp["routing"].items():
        m, boot = entry[metric], entry["route_minus_a"]
        print(f"{cls:12s} {entry['queries']:4d} {m['a']:9.3f} {m['b']:9.3f} {m['rrf']:9.3f} {m['calibrated']:11.3f} "
              f"{entry['route']:>11s} {boot['difference']:+8.3f} [{boot['low']:+.3f}, {boot['high']:+.3f}]")
    fusion = comp["fusion"]
    print(f"{'all':12s} {len(queries):4d} {fusion['a'][metric]:9.3f} {fusion['b'][metric]:9.3f} "
          f"{fusion['rrf'][metric]:9.3f} {fusion['calibrated'][metric]:11.3f}   "
          f"(max-score: {fusion['max'][metric]:.3f})")
    cells, boot = comp["win_loss"][metric]["counts"], comp["bootstrap"][metric]
    print(f"\nwin/loss cells at {metric} (A = captions, B = image): {cells}, union ceiling "
          f"{comp['win_loss'][metric]['union_ceiling']:.3f}")
    print(f"image - captions, all queries: {boot['difference']:+.3f} [{boot['low']:+.3f}, {boot['high']:+.3f}]")
    for label, b in comp["fusion_bootstrap"].items():
        print(f"{label}: {b['difference']:+.3f} [{b['low']:+.3f}, {b['high']:+.3f}]")
    mix = {"category": 0.7, "colour": 0.3}
    gain = traffic_gain(comp["routing"], mix, metric)
    print(f"\ntraffic-weighted gain of routing over captions alone, for an assumed mix {mix}: "
          f"{gain['weighted_gain']:+.3f} {metric}")


if __name__ == "__main__":
    main()
