"""A model change at catalogue scale, rehearsed through the whole migration window: time and peak memory of
every stage.

On the nightly rehearsal's store of N items after its night (bench/bench_nightly_scale.py under the same
--workdir, run first when it is not there: shards of `raw-pixels-4` vectors, d = 48, an IVF index serving, and
tonight's S3 Inventory report of the catalogue on its SeaweedFS), a copy of it goes through a change to a model
derived from the stored vectors, so that no image is read and what is measured is everything a model change runs
after the encode:

  train-head      imgest train-head --whiten --pair-images 0 (PCA whitening fitted on the live vectors)
  migrate start   the window opens: the catalogue listed from the inventory, every item's head vector derived
                  from its base shard (no image read), the head's index built
  migrate status  the window's state and both indexes
  migrate promote serving moves to the new model (--force: the rehearsal has no labelled query set)
  sync            imgest sync of the serving model to an embedded LanceDB table: a first sync of N rows
  serve           imgest api loaded on the promoted alias, answering 200 queries by item id
  migrate finish  the window closes, the old model retired

Each stage is one command run against the rehearsal's own Prefect server, with one sampler on its process tree
(RSS summed every 0.1 s, as the nightly rehearsal samples it). The encode part of a real cold start is the ingest
benchmark's images per second; `imgest report cost` turns both into hours.

    .venv/bin/python bench/bench_model_change.py --objects 1000000 --workdir /tmp/imgest-scale --json

prints {"objects": N, "stages": {"<stage>": {"seconds": s, "peak_rss_mb": m, "flow_process_peak_mb": f}},
"peak_rss_mb": m, ...} as its last line. Each stage's result is also kept in <workdir>/change/stages.json as it
ends; --resume goes on from there (a 10M rehearsal takes hours: one cut off need not start again).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.bench_nightly_scale import IMGEST, PrefectServer, task_runs  # noqa: E402
from bench.scale_catalogue import BUCKET, INVENTORY_BUCKET, MODEL, PREFIX, Catalogue, say  # noqa: E402
from bench.tree_sampler import MIB, TreeSampler, per_stage  # noqa: E402
from tests.s3servers import SeaweedServer  # noqa: E402

QUERIES = 200  # queries by item id sent to the service once it is loaded


def setup(cat: Catalogue, work: str, args) -> tuple[str, str]:
    """The store after the nightly rehearsal's night (its state is what tonight's inventory lists) and that
    inventory's manifest; the nightly rehearsal runs first when the workdir does not hold one of N objects."""
    ready = os.path.join(work, "before", "ready.json")
    store = os.path.join(work, "night", "store")
    if os.path.exists(ready):
        with open(ready) as fh:
            if json.load(fh)["objects"] != cat.n:
                raise SystemExit(f"{work} holds a rehearsal of another size; use another --workdir")
    if not os.path.exists(ready) or not os.path.exists(os.path.join(store, "aliases")):
        say("the nightly rehearsal first: its store and inventory are this rehearsal's starting point")
        subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_nightly_scale.py"), "--objects",
                        str(cat.n), "--workdir", work, "--memory", args.memory, "--kind", args.kind,
                        "--target-recall", str(args.target_recall)], check=True, cwd=ROOT)
    with open(ready) as fh:
        return store, json.load(fh)["manifest"]


def run(command: list[str], env: dict) -> str:
    done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{' '.join(command[:3])} exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                         f"{done.stderr[-3000:]}")
    return done.stdout


def sampled(name: str, command: list[str], env: dict, folder: str, during=None) -> dict:
    """Run one stage's command under the sampler; `during(proc)` runs while it does (and may end it)."""
    log = os.path.join(folder, f"{name.replace(' ', '-')}.log")
    with open(log, "w") as out:
        start = time.time()
        proc = subprocess.Popen(command, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        sampler = TreeSampler(proc.pid)
        sampler.start()
        extra = during(proc) if during is not None else {}
        code = proc.wait()
        sampler.stop()
    if code and during is None:
        with open(log) as fh:
            raise SystemExit(f"stage {name!r} exited {code}:\n{fh.read()[-4000:]}")
    end = time.time()
    say(f"{name}: {end - start:.1f} s, peak {max(s[1] for s in sampler.samples) // MIB} MB")
    intervals: dict[str, list] = {}
    for run in task_runs(env, start):  # where inside the command the memory went, by Prefect task
        if not run["subflow"]:
            intervals.setdefault(task_group(run["name"]), []).append((run["start"], run["end"]))
    tasks = {task: {"seconds": row["seconds"], "peak_rss_mb": row["peak_rss_mb"]}
             for task, row in per_stage(sampler.samples, intervals, start, end).items() if row["peak_rss_mb"]}
    return {"seconds": round(end - start, 1), "peak_rss_mb": int(max(s[1] for s in sampler.samples) // MIB),
            "flow_process_peak_mb": int(max(s[3] for s in sampler.samples) // MIB), **extra, "tasks": tasks}


def task_group(name: str) -> str:
    """A task run's name without its run-specific suffix (encode-part-<run>-<NNNNN> -> encode-part)."""
    return "encode-part" if name.startswith("encode-part") else name.rsplit("-", 1)[0]


def last_json(log: str) -> dict:
    with open(log) as fh:
        text = fh.read()
    return json.loads(text[text.rindex("\n{\n") + 1:] if "\n{\n" in text else text[text.index("{"):])


def serve(store: str, item_ids: list[str], port: int):
    """While `imgest api` runs: wait for /healthz, note its RSS, send the queries, then stop it."""
    def during(proc) -> dict:
        import psutil

        t = time.time()
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"imgest api exited {proc.returncode} before it answered")
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2).status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        loaded = time.time() - t
        resident = psutil.Process(proc.pid).memory_info().rss
        latency = []
        for item in item_ids:
            request = urllib.request.Request(f"http://127.0.0.1:{port}/search", headers={
                "Content-Type": "application/json"}, data=json.dumps({"item_id": item, "k": 10}).encode())
            a = time.perf_counter()
            if not json.loads(urllib.request.urlopen(request, timeout=60).read())["hits"]:
                raise SystemExit(f"no hits for {item}")
            latency.append(time.perf_counter() - a)
        after = psutil.Process(proc.pid).memory_info().rss
        proc.terminate()
        return {"load_seconds": round(loaded, 1), "rss_loaded_mb": resident // MIB, "rss_answered_mb": after // MIB,
                "queries": len(latency), "p50_ms": round(1000 * float(np.median(latency)), 2),
                "p99_ms": round(1000 * float(np.percentile(latency, 99)), 2)}
    return during


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, required=True, help="catalogue size N")
    parser.add_argument("--workdir", help="kept between runs: the store of the night before is reused")
    parser.add_argument("--memory", default="1G", help="the index's RAM budget (--memory of build-index, migrate)")
    parser.add_argument("--kind", default="ivfsq8", help="the index kind of both models (imgest --kind)")
    parser.add_argument("--target-recall", type=float, default=0.5,
                        help="as in the nightly rehearsal: its synthetic vectors' near ties cap SQ8's recall")
    parser.add_argument("--json", action="store_true", help="the result as one JSON line, last")
    parser.add_argument("--resume", action="store_true",
                        help="go on with the rehearsal the workdir holds: stages it recorded as done are kept "
                             "(listed under 'resumed'), the rest run")
    args = parser.parse_args()
    if args.objects < 1000:
        raise SystemExit("--objects: at least 1000")
    work = args.workdir or tempfile.mkdtemp(prefix="imgest-scale-")
    os.makedirs(work, exist_ok=True)
    cat = Catalogue(args.objects)
    t0 = time.perf_counter()
    base, manifest = setup(cat, work, args)
    seaweed = SeaweedServer(os.path.join(work, "before", "seaweedfs")).start()  # the catalogue and its inventory
    try:
        result = rehearse(args, cat, work, base, manifest, seaweed)
    finally:
        seaweed.stop()
    result["bench_seconds"] = round(time.perf_counter() - t0, 1)
    if not args.json:
        print("\n| stage | seconds | peak RSS MB |\n|---|---:|---:|")
        for stage, row in result["stages"].items():
            print(f"| {stage} | {row['seconds']} | {row['peak_rss_mb']} |")
    print(json.dumps(result))


def rehearse(args, cat: Catalogue, work: str, base: str, manifest: str, seaweed) -> dict:
    with PrefectServer(os.path.join(work, "prefect")) as prefect:
        env = prefect.env | seaweed.environment() | {"AWS_EC2_METADATA_DISABLED": "true",
                                                      "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE",
                                                                                          "Haswell")}
        folder = os.path.join(work, "change")
        store = os.path.join(folder, "store")
        stages = Stages(os.path.join(folder, "stages.json"), args.resume)
        if not stages.done:
            shutil.rmtree(folder, ignore_errors=True)
            os.makedirs(folder)
            subprocess.run(["cp", "-al", base, store], check=True)  # every write is a new file: the base stays
        index = ["--kind", args.kind, "--memory", args.memory, "--target-recall", str(args.target_recall)]
        stages.run("train-head", [IMGEST, "train-head", "--store", store, "--whiten", "--pair-images", "0",
                                  "--base-model", MODEL, "--json"], env, folder)
        head = last_json(os.path.join(folder, "train-head.log"))["head"]
        stages.run("migrate start", [IMGEST, "migrate", "start", "--store", store, "--to", head, "--catalogue",
                                     f"s3://{BUCKET}/{PREFIX}", "--inventory",
                                     f"s3://{INVENTORY_BUCKET}/{manifest}", *index], env, folder)
        stages.run("migrate status", [IMGEST, "migrate", "status", "--store", store, "--json"], env, folder)
        stages.run("migrate promote", [IMGEST, "migrate", "promote", "--store", store, "--force",
                                       "model change rehearsal"], env, folder)
        lance = os.path.join(folder, "lancedb")
        if "sync" not in stages.done:
            shutil.rmtree(lance, ignore_errors=True)  # a first sync, also when an earlier one was cut off
        stages.run("sync", [IMGEST, "sync", "--store", store, "--to", f"lancedb://{lance}/items", "--json"], env,
                   folder)
        rng = np.random.default_rng(0)
        kept = np.setdiff1d(np.arange(cat.n), cat.deleted)  # live after the night
        item_ids = cat.keys(np.sort(rng.choice(kept, QUERIES, replace=False)))
        port = free_port()
        stages.run("serve", [IMGEST, "api", "--store", store, "--port", str(port)], env, folder,
                   serve(store, item_ids, port))
        stages.run("migrate finish", [IMGEST, "migrate", "finish", "--store", store, "--retain-days", "0"], env,
                   folder)
    return {"objects": args.objects, "model": MODEL, "head": head, "memory": args.memory, "kind": args.kind,
            "target_recall": args.target_recall, "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "stages": stages.results, "resumed": sorted(stages.done),
            "peak_rss_mb": max(s["peak_rss_mb"] for s in stages.results.values())}


class Stages:
    """Each stage's result, written to `path` as soon as the stage ends (a rehearsal cut off keeps what it
    measured); with `resume`, the stages recorded there are kept and not run again."""

    def __init__(self, path: str, resume: bool):
        self.path, self.results = path, {}
        if resume and os.path.exists(path):
            with open(path) as fh:
                self.results = json.load(fh)
        self.done = set(self.results)

    def run(self, name: str, command: list[str], env: dict, folder: str, during=None) -> None:
        if name in self.done:
            say(f"{name}: kept from the run resumed ({self.results[name]['seconds']} s)")
            return
        self.results[name] = sampled(name, command, env, folder, during)
        with open(self.path + ".tmp", "w") as fh:
            json.dump(self.results, fh, indent=1)
        os.replace(self.path + ".tmp", self.path)


if __name__ == "__main__":
    main()
