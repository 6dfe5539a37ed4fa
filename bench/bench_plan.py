"""Planning at catalogue scale: a listing of N objects against an N-item snapshot (1% changed, 0.5% new,
0.5% deleted), planned by the per-item planner imgest had before (tasks/ingest/plan.py at a29ef69, loaded from git:
a Python object per item for the state and the listing), by today's columnar one alone (DuckDB joining the
listing and snapshot Parquet files on disk), and along the flow's whole state path with its own functions
(`prepare_state` on a store holding the snapshot, `plan_ingest` over the listing's file, the night's commit
markers folded, tombstones, and `write_snapshot`). Each runs in its own process; time and its peak RSS.

    .venv/bin/python bench/bench_plan.py --sizes 1000000 10000000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
OLD = "a29ef69"  # the last commit with the per-item planner


def write_inputs(n: int, work: str, seed: int = 0) -> dict:
    """snapshot.parquet (STATE_SCHEMA, n live items) and listing.parquet (LISTING_SCHEMA) after one night."""
    from imgest.images.listing import LISTING_SCHEMA
    from imgest.state.committed import STATE_SCHEMA

    rng = np.random.default_rng(seed)
    ids = np.array([f"catalogue/{i % 997:03d}/item-{i:09d}.jpg" for i in range(n)], dtype=object)
    order = np.argsort(ids)
    ids = ids[order]
    sizes = rng.integers(100_000, 400_000, n)
    etags = np.array([f"{i:032x}" for i in rng.integers(0, 2**62, n)], dtype=object)
    state = pa.table({
        "item_id": ids, "uri": np.char.add("s3://shop/", ids.astype(str)).astype(object), "status": ["live"] * n,
        "etag": etags, "size": sizes, "mtime": np.full(n, 1.7e9), "content_hash": etags, "shard": ["part-x"] * n,
        "run_id": ["r00000001"] * n, "reason": pa.nulls(n, pa.string()),
        "updated_at": ["2026-11-29T00:00:00+00:00"] * n,
    }, schema=STATE_SCHEMA)
    pq.write_table(state, os.path.join(work, "snapshot.parquet"))
    snapshots = os.path.join(work, "store", "state", "model=m", "snapshots")  # the same file, as a store holds it
    os.makedirs(snapshots)
    os.link(os.path.join(work, "snapshot.parquet"), os.path.join(snapshots, "00000001.parquet"))
    picks = rng.permutation(n)
    changed, deleted = picks[:n // 100], picks[n // 100:n // 100 + n // 200]
    listed_etags = etags.copy()
    listed_etags[changed] = [e[::-1] for e in listed_etags[changed]]
    keep = np.ones(n, bool)
    keep[deleted] = False
    new = np.array([f"catalogue/new/item-{i:09d}.jpg" for i in range(n // 200)], dtype=object)
    keys = np.concatenate([ids[keep], new])
    listing = pa.table({"key": keys, "key_ok": np.ones(len(keys), bool),
                        "size": np.concatenate([sizes[keep], rng.integers(100_000, 400_000, len(new))]),
                        "mtime": np.full(len(keys), 1.7e9 + 86400),
                        "etag": np.concatenate([listed_etags[keep], np.array(["new"] * len(new), dtype=object)]),
                        "storage_class": pa.nulls(len(keys), pa.string())}, schema=LISTING_SCHEMA)
    pq.write_table(listing.sort_by("key"), os.path.join(work, "listing.parquet"))
    return {"changed": len(changed), "new": len(new), "deleted": len(deleted)}


def peak_rss_mib() -> int:
    """This process's peak RSS since it exec'd (VmHWM). Not ru_maxrss: that keeps the high-water mark of the
    forked copy of the parent across exec, so a child would report the parent's size."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) // 1024


def old_planner():
    source = subprocess.run(["git", "-C", ROOT, "show", f"{OLD}:tasks/ingest/plan.py"], capture_output=True, text=True,
                            check=True).stdout
    module = types.ModuleType("plan_before")
    sys.modules["plan_before"] = module  # its dataclasses look their module up
    exec(compile(source, f"{OLD}:tasks/ingest/plan.py", "exec"), module.__dict__)  # our own code, from our own history
    return module.plan_ingest


def flow_path(work: str):
    """What the ingest flow does with the state on a night, minus listing and encoding: load it (the snapshot
    file read in place by DuckDB), plan against the listing file as the listing task leaves it, fold one commit
    marker per shard of the work (every object re-encoded), tombstone the unlisted, write the next snapshot."""
    from imgest.images.listing import Listing
    from imgest.state.clock import now_iso
    from imgest.state.committed import prepare_state, write_snapshot
    from imgest.storage import Location
    from imgest.tasks.ingest.plan import plan_ingest

    store = Location(os.path.join(work, "store"))
    state, _ = prepare_state(store, {"slug": "m", "model_id": "bench"})
    listing = Listing("s3://shop", files=[os.path.join(work, "listing.parquet")])
    run_id = "r00000002-x-y"
    plan = plan_ingest(listing, state, run_id, 1000, 50 << 20, 0.1)
    for shard in plan.shards:
        state.apply_commit({"shard": shard.name, "run_id": run_id, "created": now_iso(), "encoded": [
            {"item_id": i.item_id, "uri": i.uri, "etag": i.etag, "size": i.size, "mtime": i.mtime,
             "content_hash": f"h-{i.etag}"} for i in shard.items]})
    state.delete(plan.deleted, run_id, now_iso())
    write_snapshot(store, state, run_id, {"bench": True})
    return plan


def child(kind: str, work: str) -> None:
    from imgest.images.listing import LISTING_SCHEMA, Listing
    from imgest.state.committed import CatalogueState, ItemState
    from imgest.storage import ObjectInfo
    from imgest.tasks.ingest.plan import plan_ingest

    start = time.perf_counter()
    if kind == "old":  # what the flow did: the state as a dict of ItemState, the listing as ObjectInfo objects
        plan_before = old_planner()
        rows = pq.read_table(os.path.join(work, "snapshot.parquet")).to_pylist()
        state = CatalogueState("m", {r["item_id"]: ItemState(**r) for r in rows}, seq=1)
        del rows
        objects = [ObjectInfo(r["key"], r["size"], r["mtime"], r["etag"])
                   for r in pq.read_table(os.path.join(work, "listing.parquet")).to_pylist()]
        listing = types.SimpleNamespace(catalogue="s3://shop", objects=objects, skipped=0, not_regular=0)
        plan = plan_before(listing, state, "r00000002-x-y", 1000, 50 << 20, 0.1)
    elif kind == "new":
        listing = Listing("s3://shop", LISTING_SCHEMA.empty_table())
        plan = plan_ingest(listing, os.path.join(work, "snapshot.parquet"), "r00000002-x-y", 1000, 50 << 20, 0.1,
                           listing_source=os.path.join(work, "listing.parquet"))
    else:
        plan = flow_path(work)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": round(seconds, 1), "peak_rss_mib": peak_rss_mib(), "listed": plan.listed,
                      "to_read": plan.to_read, "new": plan.new,
                      "changed": plan.changed_candidates, "deleted": len(plan.deleted)}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--child", choices=["old", "new", "flow"])
    parser.add_argument("--planners", nargs="+", default=["old", "new", "flow"])
    parser.add_argument("--work")
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.work)
    rows = []
    for n in args.sizes:
        with tempfile.TemporaryDirectory(prefix="imgest-bench-plan-") as work:
            t0 = time.perf_counter()
            made = write_inputs(n, work)
            print(f"N={n:,}: inputs written in {time.perf_counter() - t0:.0f} s ({made})", flush=True)
            for kind in args.planners:
                out = subprocess.run([sys.executable, __file__, "--child", kind, "--work", work], capture_output=True,
                                     text=True)
                if out.returncode:
                    print(out.stderr[-2000:])
                    raise SystemExit(out.returncode)
                result = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append({"n": n, "planner": kind, **result})
                print(rows[-1], flush=True)
    print("\n| N | planner | seconds | peak RSS MiB | listed | to read | new | changed | deleted |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        name = {"old": f"per-item ({OLD})", "new": "columnar (DuckDB over Parquet)",
                "flow": "flow's state path (load, plan, fold, snapshot)"}[r["planner"]]
        print(f"| {r['n']:,} | {name} | {r['seconds']} | {r['peak_rss_mib']:,} | {r['listed']:,} | {r['to_read']:,} | "
              f"{r['new']:,} | {r['changed']:,} | {r['deleted']:,} |")


if __name__ == "__main__":
    main()
