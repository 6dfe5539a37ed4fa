"""Retrieval quality on real offline images: the default model against the raw-pixel floor.

    .venv/bin/python bench/bench_eval.py [--workdir /tmp/imgest-eval] [--per-class 60] [--queries-per-class 10]

Class level: Fashion-MNIST test images (Debian's dataset-fashion-mnist), queries drawn blind per class,
self-matches excluded. Instance level: scikit-image photos under crops, flips and colour changes,
each query's one relevant item being its original, among the Fashion-MNIST distractors.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from imgest.config import EvalConfig, IndexConfig, IngestConfig, NightlyConfig

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--per-class", type=int, default=60)
    parser.add_argument("--queries-per-class", type=int, default=10)
    args = parser.parse_args()

    from prefect.testing.utilities import prefect_test_harness

    from imgest.flows.build_index import build_index
    from imgest.flows.evaluate import evaluate
    from imgest.flows.ingest import ingest
    from imgest.flows.nightly import nightly
    from imgest.images.demo import build_demo_catalogue
    from imgest.reports.evaluation import render_eval
    from imgest.retrieval.querysets import build_class_queries, build_instance_queries

    work = args.workdir or tempfile.mkdtemp(prefix="imgest-eval-")
    cat, store = os.path.join(work, "catalogue"), os.path.join(work, "store")
    if not os.path.exists(cat):
        build_demo_catalogue(cat, fashion_per_class=args.per_class)
    print(f"# imgest evaluation benchmark ({time.strftime('%Y-%m-%d')})\n")
    with prefect_test_harness(server_startup_timeout=90):
        nightly(NightlyConfig(catalogue=cat, store=store))
        ingest(IngestConfig(catalogue=cat, store=store, model="raw-pixels", batch_size="64"))
        build_index(IndexConfig(store=store, model="raw-pixels", alias="pixels"))
        class_file = os.path.join(work, "class.jsonl")
        build_class_queries(cat, class_file, args.queries_per_class, seed=0, prefix="fashion/")
        instance = build_instance_queries(cat, os.path.join(work, "instance"), prefix="photos/", seed=0)
        for title, queries in (("Class level: Fashion-MNIST, 10 classes", class_file),
                               ("Instance level: scikit-image photos under crop / flip / colour", instance["file"])):
            out = os.path.join(work, title.split(":")[0].lower().replace(" ", "-"))
            report = evaluate(EvalConfig(store=store, queries=queries, alias="serving", compare="pixels", ks=(1, 5, 10),
                                         out=out))
            print(f"# {title}\n\nA = efficientnet-lite0 (serving), B = raw-pixels\n")
            print(render_eval(report))


if __name__ == "__main__":
    main()
