"""Metric-learning heads on the default model's embeddings of a real labelled set (Fashion-MNIST classes).

    .venv/bin/python bench/bench_heads.py [--workdir /tmp/imgest-heads] [--per-class 200] [--epochs 50]

For the base model and each loss, with labels and (triplet, infonce) without: recall@1/5/10 of the held-out
items (split by the labelled heads' seed; every labelled item is the gallery, the query itself excluded), the
paired bootstrap intervals of head - base at recall@1 and @10, the training report's own validation figure
(a proxy without labels), training time; then, for the best head, the time to derive its shards for the
whole catalogue from the stored base embeddings against a full re-encode (decode, base model, head).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from imgest.config import HeadConfig, IngestConfig, TrainHeadConfig

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def recall_at(vectors, rows, labels, ks=(1, 5, 10)):
    """Per query (row) and k: 1 when an item with the query's label is among the k nearest (self excluded)."""
    import numpy as np

    sims = vectors[rows] @ vectors.T
    sims[np.arange(len(rows)), rows] = -np.inf
    order = np.argsort(-sims, axis=1)[:, :max(ks)]
    same = labels[order] == labels[rows][:, None]
    return {k: same[:, :k].any(axis=1).astype(float) for k in ks}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--per-class", type=int, default=200)
    parser.add_argument("--epochs", type=int, default=50)
    args = parser.parse_args()

    import numpy as np
    from prefect.testing.utilities import prefect_test_harness

    from imgest.encoders.head import load_module
    from imgest.encoders.head import project as apply_head
    from imgest.flows.ingest import ingest
    from imgest.flows.train_head import train_head_flow
    from imgest.images.demo import build_demo_catalogue
    from imgest.retrieval.metrics import paired_bootstrap
    from imgest.state.live import load_live_vectors
    from imgest.state.models import find_model
    from imgest.storage import Location

    work = args.workdir or tempfile.mkdtemp(prefix="imgest-heads-")
    cat, store = os.path.join(work, "catalogue"), os.path.join(work, "store")
    if not os.path.exists(cat):
        build_demo_catalogue(cat, fashion_per_class=args.per_class)
    labels_file = os.path.join(work, "labels.csv")
    with open(labels_file, "w") as fh:
        fh.write("item_id,label\n")
        for label in sorted(os.listdir(os.path.join(cat, "fashion"))):
            for name in sorted(os.listdir(os.path.join(cat, "fashion", label))):
                fh.write(f"fashion/{label}/{name},{label}\n")
    print(f"# imgest head benchmark ({time.strftime('%Y-%m-%d %H:%M')}), {os.cpu_count()} cores\n")
    with prefect_test_harness(server_startup_timeout=90):
        t0 = time.perf_counter()
        base_run = ingest(IngestConfig(catalogue=cat, store=store, batch_size="4"))
        base_seconds = time.perf_counter() - t0
        loc = Location(store)
        base = find_model(loc, "efficientnet-lite0")
        live = load_live_vectors(loc, base["slug"], int(base["dim"]))
        print(f"catalogue: {base_run['listed']} images, {base_run['encoded']} encoded by {base['model_id']} "
              f"in {base_seconds:.1f} s\n")

        rows_out, heads = [], {}
        by_item = {line.split(",")[0]: line.strip().split(",")[1] for line in open(labels_file).readlines()[1:]}
        keep = [n for n, i in enumerate(live.item_ids) if i in by_item]
        ids = [live.item_ids[n] for n in keep]
        label_arr = np.array([by_item[i] for i in ids])
        position = {i: n for n, i in enumerate(ids)}
        base_vectors = live.vectors[keep]
        val_rows = None
        runs = [(loss, True) for loss in ("triplet", "infonce", "proxynca")] + \
            [(loss, False) for loss in ("triplet", "infonce")]
        for loss, labelled in runs:
            t0 = time.perf_counter()
            trained = train_head_flow(TrainHeadConfig(store=store, base_model="efficientnet-lite0",
                                                      labels=labels_file if labelled else None,
                                                      training=HeadConfig(loss=loss, epochs=args.epochs, seed=0)))
            seconds = time.perf_counter() - t0
            name = f"head, {loss}, " + ("labels" if labelled else "no labels")
            heads[name] = trained
            if val_rows is None:  # the labelled split (seeded, the same for every loss): the measured queries
                val_rows = np.array([position[i] for i in trained["result"]["val_item_ids"]])
            module = load_module(trained["folder"], trained["config"])
            head_vectors = apply_head(module, base_vectors)
            base_hits = recall_at(base_vectors, val_rows, label_arr)
            head_hits = recall_at(head_vectors, val_rows, label_arr)
            boot = {k: paired_bootstrap(base_hits[k], head_hits[k], resamples=1000, seed=0) for k in (1, 10)}
            v = trained["config"]["validation"]
            own = f"{v['recall@1']} vs base {v['base_recall@1']}" + (" (proxy)" if v["proxy"] else "")
            if not rows_out:
                rows_out.append(("base (efficientnet-lite0)", base_hits, None, None, None, "-"))
            rows_out.append((name, head_hits, boot, seconds, v["best_epoch"], own))

        print(f"Held-out split: {len(val_rows)} items of {len(ids)} labelled ({len(set(label_arr))} classes), "
              "seed 0, gallery = every labelled item, query excluded. Label-free heads never saw a label; they "
              "are measured on the same queries.\n")
        print("| retriever | recall@1 | recall@5 | recall@10 | r@1 - base, 95% CI | r@10 - base, 95% CI | "
              "training report's validation r@1 | train s | best epoch |")
        print("|---|---:|---:|---:|---|---|---|---:|---:|")
        for name, hits, boot, seconds, epoch, own in rows_out:
            def ci(k, boot=boot):
                return f"{boot[k]['difference']:+.3f} [{boot[k]['low']:+.3f}, {boot[k]['high']:+.3f}]" if boot else "-"
            print(f"| {name} | {hits[1].mean():.3f} | {hits[5].mean():.3f} | {hits[10].mean():.3f} | {ci(1)} | "
                  f"{ci(10)} | {own} | {'-' if seconds is None else round(seconds, 1)} | "
                  f"{'-' if epoch is None else epoch} |")

        best = max(rows_out[1:], key=lambda r: r[1][1].mean())[0]
        head = heads[best]["head"]
        t0 = time.perf_counter()
        derived = ingest(IngestConfig(catalogue=cat, store=store, model=head, batch_size="4"))
        derive_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        full = ingest(IngestConfig(catalogue=cat, store=os.path.join(work, "reencode-store"), model=head,
                                   batch_size="4"))
        full_seconds = time.perf_counter() - t0
        print(f"\nShards for the {best} head over the whole catalogue ({derived['encoded']} items):")
        print(f"- derived from stored base embeddings: {derive_seconds:.1f} s wall ({derived['derived']} derived, "
              f"0 decoded; encode phase {derived['encode_seconds']} s)")
        print(f"- full re-encode (read, decode, base model, head): {full_seconds:.1f} s wall "
              f"({full['encoded']} encoded; encode phase {full['encode_seconds']} s)")
        print(f"- derive / re-encode: wall {derive_seconds / full_seconds:.3f}, encode phase "
              f"{derived['encode_seconds'] / max(full['encode_seconds'], 1e-9):.4f}")


if __name__ == "__main__":
    main()
