"""float16 shards against float32: bytes on disk, and recall@10 of the served index on real embeddings.

    .venv/bin/python bench/bench_dtype.py [--images 5000]

Lite0 embeddings of Fashion-MNIST test images (Debian's dataset-fashion-mnist), encoded once; the same
vectors written as a float32 and a float16 shard. Each store's live vectors (read back in float32, as
every reader does) build the automatic index and an HNSW32 index; recall@10 is measured against exact
search on the float32 vectors, with float32 queries (queries are always embedded fresh), 1000 held-out
queries, the query item excluded, ties tolerated.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=5000)
    args = parser.parse_args()

    from PIL import Image

    from imgest import encoders
    from imgest.images.demo import read_fashion_mnist
    from imgest.retrieval.params import set_param
    from imgest.storage import Location
    from imgest.tasks.index.build import build
    from imgest.tasks.index.choice import choose_index
    from imgest.tasks.index.tuning import exact_neighbours, knn_recall, sample_queries
    from imgest.tasks.ingest.encode import encode_shard
    from imgest.tasks.ingest.plan import ShardPlan, WorkItem
    from imgest.tasks.ingest.writer import ShardWriter

    images, _ = read_fashion_mnist("t10k")
    encoder = encoders.load(encoders.resolve("efficientnet-lite0"), "cpu")
    with tempfile.TemporaryDirectory() as root:
        cat = Location(os.path.join(root, "catalogue"))
        for i in range(args.images):
            buf = io.BytesIO()
            Image.fromarray(images[i]).save(buf, "PNG")
            cat.write_bytes(f"f/{i:05d}.png", buf.getvalue())
        items = tuple(WorkItem(f"f/{i:05d}.png", cat.uri(f"f/{i:05d}.png"), 1, None, None, None)
                      for i in range(args.images))
        plan = ShardPlan("r00000001-bench-dtype", 0, items)
        stores, figures = {}, {}
        for dtype in ("float32", "float16"):
            store = Location(os.path.join(root, dtype))
            if dtype == "float32":
                result = encode_shard(plan, encoder, cat, store, batch_size=4)
                stores[dtype] = vectors32 = live_vectors(store, encoder.spec, plan)
            else:  # the same vectors, stored as float16
                writer = ShardWriter(store, encoder.spec, plan, dtype="float16")
                writer.add([(item, f"h{i}") for i, item in enumerate(items)], vectors32.vectors)
                result = writer.flush()
                stores[dtype] = live_vectors(store, encoder.spec, plan)
            figures[dtype] = {"shard_bytes": result.bytes}
        truth = stores["float32"].vectors
        query_ids = sample_queries(len(truth), 1000, seed=1)
        truth_scores, _ = exact_neighbours(truth, query_ids, 10)
        for dtype, live in stores.items():
            assert list(live.item_ids) == list(stores["float32"].item_ids)
            for kind in ("auto", "hnsw"):
                choice = choose_index(len(live), live.vectors.shape[1], "4G", kind)
                index, _ = build(np.ascontiguousarray(live.vectors), choice)
                if kind == "hnsw":
                    set_param(index, "efSearch", 64)
                _, found = index.search(truth[query_ids], 11)
                figures[dtype][f"recall@10 {choice.factory}"] = round(knn_recall(truth, query_ids, found,
                                                                                 truth_scores, 10), 4)
    print(f"{args.images} Lite0 embeddings (d={encoder.spec.dim}); recall@10 against exact float32 search")
    print("| dtype | shard bytes | " + " | ".join(k for k in figures["float32"] if k != "shard_bytes") + " |")
    for dtype, row in figures.items():
        print(f"| {dtype} | {row['shard_bytes']:,} | " + " | ".join(str(v) for k, v in row.items()
                                                                 if k != "shard_bytes") + " |")
    print(f"bytes float16 / float32: {figures['float16']['shard_bytes'] / figures['float32']['shard_bytes']:.3f}")


def live_vectors(store, spec, plan):
    """The store's live vectors as the index build reads them (in float32), after folding the one marker."""
    from imgest.state.committed import CatalogueState, write_snapshot
    from imgest.state.layout import commit_key
    from imgest.state.live import load_live_vectors

    state = CatalogueState(spec.slug, {})
    state.apply_commit(store.read_json(commit_key(spec.slug, plan.name)))
    write_snapshot(store, state, plan.run_id, {})
    return load_live_vectors(store, spec.slug, spec.dim)


if __name__ == "__main__":
    main()
