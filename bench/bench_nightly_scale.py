"""The nightly at catalogue scale, rehearsed end to end: time and peak memory of every stage of one night.

What it makes (under --workdir):
- a catalogue bucket on a loopback S3 server (SeaweedFS, the test extra's `weed`) holding tonight's new and
  changed objects as small JPEGs (their ETags are their MD5s, as S3 gives them);
- an S3 Inventory report of the whole catalogue after tonight's churn (manifest.json and Parquet data files of
  1M rows, in an inventory bucket): realistic keys, sizes, ETags, storage classes;
- a store on local disk holding the N items from the night before: shards written by imgest's own ShardWriter
  (vectors of d = 48, `raw-pixels-4` of 4x4 RGB patterns drawn around 1,024 prototypes), one full state
  snapshot (imgest's own row writer) and an IVF index built by `imgest build-index` at `--memory`.
Then it runs `imgest nightly` (the nightly deployment's flow: inventory, plan, encode, commit, drift, index
update, history row, artifacts) against its own Prefect server, with one sampler on the flow's process tree
(RSS summed over the processes every 0.1 s, and the bytes they read from disk: the page cache is dropped before
the run when this user may, so a store read is a disk read). Each stage is the Prefect task runs of that name,
read back from the server; its peak is the highest sample inside them. The unchanged objects exist only in the
inventory: the nightly never reads them, which is what is being measured.

Churn: 0.5% of the objects changed (new bytes, new ETag), 0.25% new, 0.25% deleted (1% of the catalogue).

`--metadata`: the catalogue's metadata beside it, a CSV of one row per listed object (item_id its key, product_id,
title ~40-80 characters, category, price, colour, description ~200-600 characters; generated and written a block
at a time), passed to the night (`--metadata`), which stores the first snapshot. Then a second night over the
same catalogue with a second file where 1% of the rows have a new title and price; it must store exactly one new
snapshot, differing from the first in exactly those rows. The metadata task is the stage `metadata`, the caption
retriever's text listing `caption texts`. `--captions` adds the caption retriever (minilm-l6: every row's text
encoded once, an alias `captions`) between the two nights, so the second night must encode exactly the changed
rows' text; without it only the image model runs and the second night checks the snapshot.

`--plan-only`: the inventory and the state only (no bucket, no shards, no index, no encode): the flow's
functions for loading the state, reading the inventory and planning, each timed, in one sampled process.

Needs the test extra (SeaweedFS's `weed`, psutil), as `.venv` from infra/setup.sh has it.

    .venv/bin/python bench/bench_nightly_scale.py --objects 1000000 --workdir /tmp/imgest-scale --json
    .venv/bin/python bench/bench_nightly_scale.py --objects 100000000 --plan-only --workdir /tmp/imgest-plan --json
    .venv/bin/python bench/bench_nightly_scale.py --objects 20000 --metadata --captions --workdir /tmp/meta --json

prints {"objects": N, "stages": {"<stage>": {"seconds": s, "peak_rss_mb": m, "read_mb": r}},
"peak_rss_mb": m, ...} as its last line; with --metadata also "metadata" (rows, changed rows, MiB) and "second_night"
(its stages and checks).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.scale_catalogue import (  # noqa: E402
    BUCKET,
    INVENTORY_BUCKET,
    MODEL,
    PREFIX,
    RUN_BEFORE,
    SHARD_SIZE,
    Catalogue,
    listed_ids,
    metadata_changed,
    say,
    upload_tonight,
    write_inventory,
    write_metadata,
    write_store,
)
from bench.tree_sampler import MIB, TreeSampler, drop_page_cache, per_stage  # noqa: E402

IMGEST = os.path.join(os.path.dirname(sys.executable), "imgest")  # the console script beside this interpreter

# Prefect task run names (before their random suffix) -> the stage of the night they belong to, in flow order
STAGES = [
    ("state load", ("load-state",)),
    ("inventory read and listing spill", ("read-inventory",)),
    ("metadata", ("store-metadata",)),
    ("caption texts", ("list-texts",)),
    ("plan", ("plan-shards",)),
    ("encode", ("choose-encoding", "encode-")),
    ("commit (state delta)", ("commit",)),
    ("drift", ("measure-drift",)),
    ("index update", ("previous-version", "update-index", "number-live", "choose-index", "train-index", "build-index",
                      "add-part", "add-store-part", "tune-search", "index-card")),
    ("index write and alias", ("write-version", "verify-and-alias", "write-drift-reference")),
    ("history row", ("record-night",)),
    ("duplicates", ("choose-threshold", "find-duplicates")),
    ("sync", ("sync",)),
    ("trend artifact", ("nightly-trend",)),
]


# ---- the servers ------------------------------------------------------------------------------------------------

class PrefectServer:
    """`prefect server start` on a free loopback port, its database under `home`."""

    def __init__(self, home: str):
        from tests.s3servers import free_port

        self.port, self.home = free_port(), home
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.env = {"PREFECT_HOME": home, "PREFECT_API_URL": self.url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> PrefectServer:
        from imgest.cli.prefect_stack import wait_healthy

        os.makedirs(self.home, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                      "--port", str(self.port)], env={**os.environ, **self.env},
                                     stdout=open(os.path.join(self.home, "server.log"), "ab"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        wait_healthy(self.url, 120, lambda: self.proc.poll() is None)
        return self

    def __exit__(self, *exc) -> None:
        from imgest.cli.prefect_stack import stop

        stop(self.proc, "prefect server", signals=1, say=say)


def task_runs(env: dict, since: float) -> list[dict]:
    """Every task run that started after `since`, read back from the server (runs are recorded asynchronously:
    read until two reads agree)."""
    code = f"""
import json
from prefect.client.orchestration import get_client
runs, offset = [], 0
with get_client(sync_client=True) as client:
    while True:
        page = client.read_task_runs(limit=200, offset=offset)
        runs += [{{"name": r.name, "subflow": bool(r.state and r.state.state_details.child_flow_run_id),
                  "start": r.start_time.timestamp(), "end": r.end_time.timestamp()}}
                 for r in page if r.start_time is not None and r.end_time is not None
                 and r.start_time.timestamp() >= {since}]
        if len(page) < 200:
            break
        offset += 200
print(json.dumps(runs))
"""
    previous = None
    for _ in range(20):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                             check=True)
        runs = json.loads(out.stdout.strip().splitlines()[-1])
        if previous is not None and len(runs) == len(previous):
            return runs
        previous = runs
        time.sleep(2)
    return previous


def stage_of(name: str) -> str:
    for stage, prefixes in STAGES:
        if any(name.startswith(p) for p in prefixes):
            return stage
    return name.rsplit("-", 1)[0]


# ---- the two runs -----------------------------------------------------------------------------------------------

def run_sampled(command: list[str], env: dict, log: str) -> tuple[TreeSampler, float, float, int]:
    with open(log, "w") as out:
        start = time.time()
        proc = subprocess.Popen(command, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        sampler = TreeSampler(proc.pid)
        sampler.start()
        code = proc.wait()
        end = time.time()
        sampler.stop()
    return sampler, start, end, code


CAPTION_MODEL = "minilm-l6"


def sampled_night(command: list[str], env: dict, prefect_env: dict, folder: str) -> dict:
    """One `imgest nightly`, sampled: its stages (Prefect task runs by name, read back from the server) with
    seconds, peak RSS and bytes read, and its log."""
    os.makedirs(folder, exist_ok=True)
    dropped = drop_page_cache()
    log = os.path.join(folder, "nightly.log")
    sampler, start, end, code = run_sampled(command, env, log)
    if code:
        with open(log) as fh:
            raise SystemExit(f"imgest nightly exited {code}:\n{fh.read()[-4000:]}")
    runs = task_runs(prefect_env, start)
    with open(os.path.join(folder, "task_runs.json"), "w") as fh:
        json.dump(runs, fh, indent=1)
    intervals: dict[str, list] = {}
    for run in runs:
        if run["subflow"]:  # a subflow's own task run: its tasks are counted one by one
            continue
        intervals.setdefault(stage_of(run["name"]), []).append((run["start"], run["end"]))
    order = [s for s, _ in STAGES if s in intervals] + sorted(set(intervals) - {s for s, _ in STAGES})
    with open(log) as fh:
        text = fh.read()
    return {"stages": per_stage(sampler.samples, {s: intervals[s] for s in order}, start, end),
            "wall_seconds": round(end - start, 1), "samples": len(sampler.samples), "page_cache_dropped": dropped,
            "read_mb": round(sampler.samples[-1][2] / MIB, 1),
            "peak_rss_mb": int(max(s[1] for s in sampler.samples) // MIB), "log": text}


def nightly_run(args, cat: Catalogue, work: str) -> dict:
    from tests.s3servers import SeaweedServer, _client

    setup: dict = {}
    if not os.path.exists(os.path.join(work, "before", "ready.json")):  # a setup cut short: start again
        shutil.rmtree(os.path.join(work, "before"), ignore_errors=True)
    seaweed = SeaweedServer(os.path.join(work, "before", "seaweedfs")).start()
    try:
        env = seaweed.environment() | {"AWS_EC2_METADATA_DISABLED": "true"}
        client = _client(seaweed.url)
        with PrefectServer(os.path.join(work, "prefect")) as prefect:
            env |= prefect.env
            base = os.path.join(work, "before", "store")
            if not os.path.exists(os.path.join(work, "before", "ready.json")):
                t = time.perf_counter()
                for bucket in (BUCKET, INVENTORY_BUCKET):
                    client.create_bucket(Bucket=bucket)
                tonight = upload_tonight(cat, client)
                setup["upload_seconds"] = round(time.perf_counter() - t, 1)
                say(f"catalogue: {len(tonight):,} objects of tonight uploaded in {setup['upload_seconds']} s")
                t = time.perf_counter()
                manifest = write_inventory(cat, tonight, lambda k, d: client.put_object(
                    Bucket=INVENTORY_BUCKET, Key=k, Body=d))
                setup["inventory_seconds"] = round(time.perf_counter() - t, 1)
                say(f"inventory written in {setup['inventory_seconds']} s")
                t = time.perf_counter()
                write_store(cat, base, with_shards=True)
                setup["store_seconds"] = round(time.perf_counter() - t, 1)
                say(f"store (shards, snapshot) written in {setup['store_seconds']} s")
                t = time.perf_counter()
                built = subprocess.run([IMGEST, "build-index", "--store", base,
                                        "--model", cat.model, "--memory", args.memory, "--kind", args.kind,
                                        "--target-recall", str(args.target_recall)],
                                       env={**os.environ, **env}, capture_output=True, text=True, cwd=ROOT)
                if built.returncode:
                    raise SystemExit(f"build-index failed:\n{built.stdout[-3000:]}\n{built.stderr[-3000:]}")
                setup["index_build_seconds"] = round(time.perf_counter() - t, 1)
                say(f"index built in {setup['index_build_seconds']} s")
                with open(os.path.join(work, "before", "ready.json"), "w") as fh:
                    json.dump({"objects": cat.n, "copy_every": cat.copy_every, "model": cat.model,
                               "manifest": manifest, "setup": setup}, fh)
            with open(os.path.join(work, "before", "ready.json")) as fh:
                ready = json.load(fh)
            if (ready["objects"], ready.get("copy_every", 0), ready.get("model", MODEL)) != \
                    (cat.n, cat.copy_every, cat.model):
                raise SystemExit(f"{work} holds a rehearsal of {ready['objects']:,} objects of "
                                 f"{ready.get('model', MODEL)}, one copy in every {ready.get('copy_every', 0)} (0: "
                                 "none); use another --workdir")
            metadata = metadata_files(cat, os.path.join(work, "before")) if args.metadata else None
            store = os.path.join(work, "night", "store")
            shutil.rmtree(os.path.join(work, "night"), ignore_errors=True)
            shutil.rmtree(os.path.join(work, "night-2"), ignore_errors=True)
            os.makedirs(os.path.join(work, "night"))
            subprocess.run(["cp", "-al", base, store], check=True)  # the night writes new files; the base stays
            say(f"nightly over {cat.n:,} objects{' with its metadata (first snapshot)' if metadata else ''}")
            command = [IMGEST, "nightly", "--store", store,
                       "--catalogue", f"s3://{BUCKET}/{PREFIX}", "--model", cat.model, "--dtype", cat.dtype,
                       "--memory", args.memory,
                       "--kind", args.kind, "--target-recall", str(args.target_recall), "--inventory", f"s3://{INVENTORY_BUCKET}/{ready['manifest']}"]
            command += ["--report-duplicates"] if args.report_duplicates else []
            command += [flag for target in args.sync_to for flag in ("--sync-to", target)]
            night = sampled_night(command + (["--metadata", metadata["files"][0]] if metadata else []), env,
                                  prefect.env, os.path.join(work, "night"))
            checks = check_store(cat, store)
            checks["index_updated_in_place"] = "updated in place" in night.pop("log")
            if args.report_duplicates:
                checks["duplicates"] = check_duplicates(cat, store)
            second = None
            if metadata:
                checks |= check_first_snapshot(store, metadata)
                if args.captions:
                    setup |= caption_model(store, command, env)
                say(f"second night: the metadata with {metadata['changed']:,} rows changed (title and price)")
                second = sampled_night(command + ["--metadata", metadata["files"][1]], env, prefect.env,
                                       os.path.join(work, "night-2"))
                second.pop("log")
                second["checks"] = check_second_night(store, metadata, args.captions)
    finally:
        seaweed.stop()
    out = {**night, "setup": ready["setup"] | setup, "checks": checks}
    if metadata:
        out["metadata"] = {k: v for k, v in metadata.items() if k != "files"}
        out["second_night"] = second
    return out


def metadata_files(cat: Catalogue, folder: str) -> dict:
    """The catalogue's metadata CSV (one row per listed object) and the second night's, 1% of its rows with a new
    title and price; kept with the setup."""
    files = [os.path.join(folder, f"metadata-{version}.csv") for version in (1, 2)]
    for version, path in enumerate(files, 1):
        if not os.path.exists(path):
            t = time.perf_counter()
            written = write_metadata(cat, path, version)
            say(f"metadata {version}: {written['rows']:,} rows, {written['bytes'] / MIB:,.0f} MiB in "
                f"{time.perf_counter() - t:.1f} s")
    rows = len(listed_ids(cat))
    return {"files": files, "rows": rows, "changed": int(metadata_changed(np.arange(rows)).sum()),
            "mib": round(os.path.getsize(files[0]) / MIB, 1)}


def snapshots(store_dir: str) -> list[str]:
    folder = os.path.join(store_dir, "metadata", "snapshots")
    return sorted(n for n in os.listdir(folder) if n.endswith(".parquet")) if os.path.isdir(folder) else []


def check_first_snapshot(store_dir: str, metadata: dict) -> dict:
    """The first night stored one snapshot of every row."""
    import pyarrow.parquet as pq

    names = snapshots(store_dir)
    rows = pq.read_metadata(os.path.join(store_dir, "metadata", "snapshots", names[-1])).num_rows if names else 0
    return {"metadata_snapshots": len(names), "metadata_rows": rows, "metadata_rows_expected": metadata["rows"]}


def caption_model(store: str, nightly_command: list[str], env: dict) -> dict:
    """The caption retriever added to the store after the first night: minilm-l6 ingests every row's text and gets
    the `captions` alias, so the second night keeps it current beside the image model."""
    catalogue = nightly_command[nightly_command.index("--catalogue") + 1]
    inventory = nightly_command[nightly_command.index("--inventory") + 1]
    timings = {}
    for name, command in (("captions_ingest_seconds", ["ingest", "--catalogue", catalogue, "--inventory", inventory,
                                                       "--store", store, "--model", CAPTION_MODEL]),
                          ("captions_index_seconds", ["build-index", "--store", store, "--model", CAPTION_MODEL,
                                                      "--alias", "captions"])):
        t = time.perf_counter()
        done = subprocess.run([IMGEST, *command], env={**os.environ, **env}, capture_output=True, text=True, cwd=ROOT)
        if done.returncode:
            raise SystemExit(f"imgest {command[0]} ({CAPTION_MODEL}) failed:\n{done.stdout[-3000:]}\n"
                             f"{done.stderr[-3000:]}")
        timings[name] = round(time.perf_counter() - t, 1)
        say(f"captions: {command[0]} in {timings[name]} s")
    return timings


def check_second_night(store_dir: str, metadata: dict, captions: bool) -> dict:
    """After the 1% night: exactly one new snapshot, differing from the first in exactly the changed rows; with the
    caption model, exactly those rows' text encoded tonight (its state's rows of tonight's run)."""
    import duckdb

    names = snapshots(store_dir)
    folder = os.path.join(store_dir, "metadata", "snapshots")
    checks: dict = {"metadata_snapshots": len(names), "metadata_snapshots_expected": 2,
                    "metadata_changed_expected": metadata["changed"]}
    if len(names) >= 2:
        old, new = (os.path.join(folder, n).replace("'", "''") for n in names[-2:])
        checks["metadata_rows"], checks["metadata_changed"] = duckdb.sql(f"""
            SELECT count(*), count(*) FILTER (o.row_hash IS DISTINCT FROM n.row_hash)
            FROM read_parquet('{new}') n FULL JOIN read_parquet('{old}') o USING (item_id)""").fetchall()[0]
    if captions:
        from imgest import encoders
        from imgest.state.committed import load_state
        from imgest.storage import Location

        state = load_state(Location(store_dir), encoders.resolve(CAPTION_MODEL).slug)
        try:
            runs = state.query("SELECT run_id, count(*) AS n FROM state WHERE status = 'live' GROUP BY run_id "
                               "ORDER BY run_id").to_pylist()
        finally:
            state.close()
        checks["captions_live"] = sum(r["n"] for r in runs)
        checks["captions_encoded_tonight"] = runs[-1]["n"] if len(runs) > 1 else 0
        checks["captions_encoded_expected"] = metadata["changed"]
    checks["ok"] = (checks["metadata_snapshots"] == 2 and checks.get("metadata_changed") == metadata["changed"]
                    and checks.get("metadata_rows") == metadata["rows"]
                    and (not captions or checks["captions_encoded_tonight"] == metadata["changed"]))
    return checks


def check_store(cat: Catalogue, store_dir: str) -> dict:
    """The state the night left: live = before - deleted + new, and tonight's objects encoded."""
    from imgest import encoders
    from imgest.state.committed import load_state
    from imgest.storage import Location

    state = load_state(Location(store_dir), encoders.resolve(cat.model).slug)
    live = state.count("live")
    tonight = state.query("SELECT count(*) AS n FROM state WHERE run_id <> ? AND status = 'live'", [RUN_BEFORE])
    return {"live": live, "live_expected": cat.n - len(cat.deleted) + len(cat.new),
            "encoded_tonight": tonight["n"][0].as_py(), "encoded_expected": len(cat.changed) + len(cat.new)}


def check_duplicates(cat: Catalogue, store_dir: str) -> dict:
    """The night's duplicates report against the catalogue's copies: how many copy pairs are live after tonight
    (neither side changed or deleted; tonight's new copies too: the same JPEG), how many of them the report puts
    in one group, and its groups and pairs as it counts them."""
    import glob

    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    reports = sorted(glob.glob(os.path.join(store_dir, "duplicates", "model=*", "*.parquet")))
    if not reports or not cat.copy_every:
        return {"duplicates_report": bool(reports)}
    ids = np.concatenate([np.arange(cat.n), cat.new])
    touched = np.zeros(cat.n + len(cat.new), bool)
    touched[np.concatenate([cat.changed, cat.deleted])] = True
    copies = ids[(cat.sources(ids) != ids) & ~touched[ids] & ~touched[ids - 1]]
    copies = copies[(copies < cat.n) | (copies - 1 >= cat.n)]  # a new object copies a new one, an old one an old
    report = pq.read_table(reports[-1], columns=["group", "item_id"])
    meta = report.schema.metadata
    group_of = dict(zip(report["item_id"].to_pylist(), report["group"].to_pylist())) if len(report) < 5_000_000 else {}
    keys, sources = Catalogue.keys(copies), Catalogue.keys(copies - 1)
    together = sum(1 for a, b in zip(keys, sources) if a in group_of and group_of.get(a) == group_of.get(b))
    return {"copy_pairs_live": len(copies), "copy_pairs_grouped": together,
            "groups": json.loads(meta[b"imgest.groups"]), "grouped_items": json.loads(meta[b"imgest.grouped_items"]),
            "pairs": int(meta[b"imgest.pairs"]), "report_rows": len(report),
            "largest_group": int(pc.max(pc.value_counts(report["group"]).field("counts")).as_py() or 0)}


PLAN_CHILD = """
import json, sys, time
sys.path.insert(0, {root!r})
from imgest import encoders
from imgest.storage import Location
from imgest.tasks.ingest.inventory import read_inventory
from imgest.tasks.ingest.plan import plan_ingest
from imgest.state.committed import new_run_id, prepare_state

def mark(stage, start):
    print(json.dumps({{"stage": stage, "start": start, "end": time.time()}}), flush=True)

t = time.time()
state, _ = prepare_state(Location({store!r}), encoders.resolve({model!r}).describe())
mark("state load", t)
t = time.time()
listing = read_inventory({manifest!r}, "s3://{bucket}/{prefix}")
mark("inventory read and listing spill", t)
t = time.time()
plan = plan_ingest(listing, state, new_run_id(state.seq + 1), {shard}, 256 << 20, 0.1)
mark("plan", t)
print(json.dumps({{"listed": plan.listed, "to_read": plan.to_read, "new": plan.new,
                   "changed": plan.changed_candidates, "deleted": len(plan.deleted)}}), flush=True)
"""


def plan_run(args, cat: Catalogue, work: str) -> dict:
    folder = os.path.join(work, "plan")
    ready_file = os.path.join(folder, "ready.json")
    if not os.path.exists(ready_file):
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(os.path.join(folder, "inventory"))
        tonight = {int(i): (hashlib.md5(f"tonight-{i}".encode()).hexdigest(), 1_000)
                   for i in np.concatenate([cat.changed, cat.new])}  # ETags as S3 would list them; never read

        def put(key: str, data: bytes) -> None:
            path = os.path.join(folder, "inventory", key)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as fh:
                fh.write(data)

        t = time.perf_counter()
        manifest = write_inventory(cat, tonight, put)
        say(f"inventory written in {time.perf_counter() - t:.0f} s")
        t = time.perf_counter()
        write_store(cat, os.path.join(folder, "before"), with_shards=False)
        say(f"state snapshot written in {time.perf_counter() - t:.0f} s")
        with open(ready_file, "w") as fh:
            json.dump({"objects": cat.n, "manifest": os.path.join(folder, "inventory", manifest)}, fh)
    with open(ready_file) as fh:
        ready = json.load(fh)
    if ready["objects"] != cat.n:
        raise SystemExit(f"{work} holds a rehearsal of {ready['objects']:,} objects; use another --workdir")
    store = os.path.join(folder, "store")
    shutil.rmtree(store, ignore_errors=True)
    subprocess.run(["cp", "-al", os.path.join(folder, "before"), store], check=True)
    code = PLAN_CHILD.format(root=ROOT, store=store, model=cat.model, manifest=ready["manifest"], bucket=BUCKET,
                             prefix=PREFIX, shard=SHARD_SIZE)
    dropped = drop_page_cache()
    log = os.path.join(folder, "plan.log")
    sampler, start, end, exit_code = run_sampled([sys.executable, "-c", code], {}, log)
    with open(log) as fh:
        lines = [json.loads(line) for line in fh if line.startswith("{")]
    if exit_code or not lines:
        with open(log) as fh:
            raise SystemExit(f"planning exited {exit_code}:\n{fh.read()[-4000:]}")
    intervals = {line["stage"]: [(line["start"], line["end"])] for line in lines if "stage" in line}
    return {"stages": per_stage(sampler.samples, intervals, start, end), "wall_seconds": round(end - start, 1),
            "page_cache_dropped": dropped, "read_mb": round(sampler.samples[-1][2] / MIB, 1),
            "peak_rss_mb": int(max(s[1] for s in sampler.samples) // MIB), "plan": lines[-1],
            "expected": {"changed": len(cat.changed), "new": len(cat.new), "deleted": len(cat.deleted)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, required=True, help="catalogue size N (objects the night before)")
    parser.add_argument("--workdir", help="kept between runs: a second run of the same N reuses its setup")
    parser.add_argument("--memory", default="1G", help="the index's RAM budget (imgest build-index/nightly --memory)")
    parser.add_argument("--kind", default="ivfsq8", help="the index kind (imgest --kind): an IVF one is updated in "
                        "place each night; auto picks the same past 100k items (HNSW, rebuilt each night, below)")
    parser.add_argument("--target-recall", type=float, default=0.5,
                        help="the recall@10 the index is tuned to: the synthetic vectors (4x4 patterns around "
                             "1,024 prototypes) have near-tied neighbours that SQ8 codes cannot order at 10M, so "
                             "0.95 is out of reach there and a missed target makes the night train anew; this "
                             "rehearsal measures time and memory, not recall")
    parser.add_argument("--plan-only", action="store_true", help="inventory and state only: no bucket, encode, index")
    parser.add_argument("--metadata", action="store_true",
                        help="a metadata CSV of the catalogue (title, category, price, colour, description) passed to "
                             "the night, which stores its first snapshot; then a second night with 1%% of the rows' "
                             "title and price changed, checked to store exactly one new snapshot")
    parser.add_argument("--captions", action="store_true",
                        help="with --metadata: after the first night, the caption retriever (minilm-l6) ingests every "
                             "row's text and gets an alias, so the second night must encode exactly the changed "
                             "rows' text (a text model on every row: slow on a CPU past ~100k rows)")
    parser.add_argument("--model", default=MODEL, choices=(MODEL, "efficientnet-lite0"),
                        help="the catalogue's model: raw-pixels-4 (d=48, its cost is not what is measured) or "
                             "efficientnet-lite0 (d=1,280 in float16 shards, as users store it; tonight's objects "
                             "encoded by the real model)")
    parser.add_argument("--copies", type=float, default=0.0,
                        help="this share of the catalogue are copies of another object (same bytes, own key): 0.05 "
                             "for a catalogue with 5%% copies, for --report-duplicates")
    parser.add_argument("--report-duplicates", action="store_true",
                        help="the nights report duplicate groups (imgest nightly --report-duplicates): stage "
                             "`duplicates`")
    parser.add_argument("--sync-to", action="append", default=[],
                        help="the nights sync the serving model there (imgest nightly --sync-to; repeat for "
                             "several), e.g. lancedb://<workdir>/lance/items: stage `sync`")
    parser.add_argument("--json", action="store_true", help="the result as one JSON line, last")
    args = parser.parse_args()
    if args.objects < 1000:
        raise SystemExit("--objects: at least 1000 (1% churn of fewer is nothing)")
    if args.captions and not args.metadata:
        raise SystemExit("--captions: needs --metadata (the caption retriever reads the catalogue's metadata)")
    if args.plan_only and args.metadata:
        raise SystemExit("--metadata: runs the nightly; leave out --plan-only")
    work = args.workdir or tempfile.mkdtemp(prefix="imgest-scale-")
    os.makedirs(work, exist_ok=True)
    cat = Catalogue(args.objects, copies=args.copies, model=args.model)
    t = time.perf_counter()
    result = plan_run(args, cat, work) if args.plan_only else nightly_run(args, cat, work)
    result = {"objects": args.objects, "mode": "plan-only" if args.plan_only else "nightly", "model": cat.model,
              "dtype": cat.dtype,
              "copies": args.copies, "report_duplicates": args.report_duplicates, "sync_to": args.sync_to,
              "memory": args.memory, "kind": args.kind, "target_recall": args.target_recall,
              "date": datetime.now(UTC).isoformat(timespec="seconds"),
              **result,
              "bench_seconds": round(time.perf_counter() - t, 1)}
    if not args.json:
        print("\n| stage | seconds | peak RSS MB | read MB | tasks |\n|---|---:|---:|---:|---:|")
        for stage, row in result["stages"].items():
            print(f"| {stage} | {row['seconds']} | {row['peak_rss_mb']} | {row['read_mb']} | {row['tasks']} |")
        if result.get("second_night"):
            print("\nthe second night (1% of the metadata rows changed):\n\n"
                  "| stage | seconds | peak RSS MB | read MB | tasks |\n|---|---:|---:|---:|---:|")
            for stage, row in result["second_night"]["stages"].items():
                print(f"| {stage} | {row['seconds']} | {row['peak_rss_mb']} | {row['read_mb']} | {row['tasks']} |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
