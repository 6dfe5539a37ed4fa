"""Evaluate retrievers on a labelled query set: served vs exact, per class, win/loss, bootstrap, fusion."""

from __future__ import annotations

import json
import os
from collections import defaultdict

import numpy as np
import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

from imgest.plots import bootstrap_png, recall_sweep_png
from imgest.retrieval.fusion import max_score, rrf
from imgest.retrieval.metrics import evaluate, paired_bootstrap, per_query, win_loss
from imgest.retrieval.query import Query, Searcher
from imgest.retrieval.querysets import LabelledQuery, QuerySetError
from imgest.retrieval.routing import (
    FOLDS,
    candidate_runs,
    fit_calibration,
    read_traffic,
    routing_file,
    routing_table,
    traffic_gain,
)
from imgest.retrieval.topk import keep_best
from imgest.retrieval.versions import read_card, served_parameters
from imgest.state.aliases import read_alias
from imgest.state.live import live_set, read_shard_vectors, shard_groups
from imgest.state.rows import sql_string
from imgest.storage import Location

EMBED_CHUNK = 64


def metric_names(ks: list[int]) -> list[str]:
    return [f"recall@{k}" for k in ks] + [f"precision@{k}" for k in ks] + ["mrr", "map"]


def embed(searcher: Searcher, queries: list[LabelledQuery]) -> np.ndarray:
    chunks = [searcher.embed([Query(q.query_id, q.image, q.text) for q in queries[i:i + EMBED_CHUNK]])
              for i in range(0, len(queries), EMBED_CHUNK)]
    return np.concatenate(chunks) if chunks else np.zeros((0, searcher.spec.dim), np.float32)


def ranked(queries, scores, names, depth) -> tuple[dict, dict]:
    """Each query's ranked item ids and (item, score) pairs, its excluded items left out; `names`: the item of
    each hit (None where there was none)."""
    run, score_run = {}, {}
    for q, srow, nrow in zip(queries, scores, names):
        drop = set(q.exclude)
        pairs = [(n, float(s)) for s, n in zip(srow, nrow) if n is not None and n not in drop][:depth]
        run[q.query_id] = [p[0] for p in pairs]
        score_run[q.query_id] = pairs
    return run, score_run


def _named(searcher: Searcher, ids: np.ndarray) -> np.ndarray:
    """The item of each faiss id in `ids` (None for -1), read from the version's mapped id map."""
    names = np.full(ids.shape, None, object)
    names[ids >= 0] = searcher.opened.ids.take_array(searcher.opened.item_ids, ids[ids >= 0]).to_numpy(
        zero_copy_only=False)
    return names


class ExactScan:
    """The exact nearest `k` of each query among vectors seen a block at a time: each block's best `k` merged
    with the best so far (what is held: queries x k scores and names, one block)."""

    def __init__(self, queries: np.ndarray, k: int):
        self.queries, self.k = np.ascontiguousarray(queries, np.float32), k
        self.scores = np.full((len(queries), 0), -np.inf, np.float32)
        self.names = np.full((len(queries), 0), None, object)

    def add(self, vectors: np.ndarray, items: pa.Array) -> None:
        import faiss

        if not len(vectors) or not len(self.queries):
            return
        scores, local = faiss.knn(self.queries, np.ascontiguousarray(vectors, np.float32), min(self.k, len(vectors)),
                                  metric=faiss.METRIC_INNER_PRODUCT)
        names = items.take(pa.array(local.ravel())).to_numpy(zero_copy_only=False).reshape(local.shape)
        self.scores, self.names = keep_best(self.scores, self.names, scores, names, self.k)


def served_and_exact(store: Location, searcher: Searcher, queries: list[LabelledQuery], depth: int) -> dict:
    """The same query vectors through the served index (its served parameters) and through exact search over
    the vectors of the items it holds that are live now, read a shard at a time (the live set and the version's
    id map joined on disk in DuckDB: nothing per catalogue item in memory)."""
    vectors = embed(searcher, queries)
    extra = max((len(q.exclude) for q in queries), default=0)
    scores, ids = searcher.opened.search(vectors, depth + extra)
    served, served_scores = ranked(queries, scores, _named(searcher, ids), depth)
    card = searcher.card
    live = live_set(store, card["slug"])
    both = os.path.join(live.folder, "evaluated.parquet")
    with live.connect() as con:
        con.execute(f"""COPY (SELECT shard, item_id FROM live
                              SEMI JOIN read_parquet({sql_string(searcher.opened.ids.parquet)}) USING (item_id)
                              ORDER BY shard, item_id) TO {sql_string(both)} (FORMAT parquet)""")
    scan = ExactScan(vectors, depth + extra)
    for group in shard_groups(both):
        items = group["item_id"].combine_chunks()
        block, found = read_shard_vectors(store, card["slug"], card["d"], group["shard"][0].as_py(), items)
        scan.add(block, items.take(pa.array(found)))
    exact, _ = ranked(queries, scan.scores, scan.names, depth)
    return {"served": served, "served_scores": served_scores, "exact": exact}


def describe(searcher: Searcher, alias: str) -> dict:
    card = searcher.card
    return {"alias": alias, "model_id": card["model_id"], "slug": card["slug"], "version": card["version"],
            "factory": card["factory"], "served": served_parameters(card), "n": card["n"]}


def by_class(run, qrels, classes, names) -> dict:
    groups = defaultdict(dict)
    for qid, cls in classes.items():
        groups[cls or "_all"][qid] = qrels[qid]
    return {cls: {"queries": len(rel), **evaluate(run, rel, names)} for cls, rel in sorted(groups.items())}


def check_coverage(searcher: Searcher, queries: list[LabelledQuery]) -> float:
    """Share of the queries' relevant ids that the index holds; none at all means the set was built
    for another catalogue root or store, and every metric would silently be 0."""
    relevant = {item for q in queries for item in q.relevant}
    held = searcher.opened.ids.positions(sorted(relevant))
    share = float((held >= 0).mean()) if relevant else 0.0
    if share == 0:
        example = next(iter(relevant), "?")
        raise QuerySetError(f"none of the {len(relevant)} relevant item ids (e.g. {example!r}) is in the index "
                            f"{searcher.card['slug']} v{searcher.card['version']}: was the query set built from "
                            "another catalogue root? Item ids are keys relative to the ingested catalogue")
    return share


def evaluate_retriever(store: Location, alias: str, queries: list[LabelledQuery], ks: list[int],
                       device: str = "auto") -> dict:
    searcher = Searcher(store.url, alias=alias, device=device)
    coverage = check_coverage(searcher, queries)
    depth = max(max(ks), 100)
    runs = served_and_exact(store, searcher, queries, depth)
    qrels = {q.query_id: set(q.relevant) for q in queries}
    names = metric_names(ks)
    served = evaluate(runs["served"], qrels, names)
    exact = evaluate(runs["exact"], qrels, names)
    classes = {q.query_id: q.cls for q in queries}
    return {
        **describe(searcher, alias),
        "relevant_indexed_share": round(coverage, 6),
        "metrics": served,
        "exact": exact,
        "served_over_exact": {m: (served[m] / exact[m] if exact[m] else None) for m in names},
        "per_class": by_class(runs["served"], qrels, classes, names) if any(classes.values()) else {},
        "_runs": runs,
    }


def compare(a: dict, b: dict, queries: list[LabelledQuery], ks: list[int], resamples: int = 1000,
            seed: int = 0) -> dict:
    """A vs B on the same queries: win/loss cells, paired bootstrap on the recall difference, fusion."""
    qrels = {q.query_id: set(q.relevant) for q in queries}
    out = {"win_loss": {}, "bootstrap": {}, "fusion": {}}
    for k in ks:
        metric = f"recall@{k}"
        hits_a = per_query(a["_runs"]["served"], qrels, metric)
        hits_b = per_query(b["_runs"]["served"], qrels, metric)
        out["win_loss"][metric] = win_loss(hits_a, hits_b)
        out["bootstrap"][metric] = paired_bootstrap([hits_a[q] for q in qrels], [hits_b[q] for q in qrels],
                                                    resamples=resamples, seed=seed)
    fused_rrf, fused_max = {}, {}
    for q in qrels:
        fused_rrf[q] = [d for d, _ in rrf([a["_runs"]["served"][q], b["_runs"]["served"][q]])]
        fused_max[q] = [d for d, _ in max_score([a["_runs"]["served_scores"][q], b["_runs"]["served_scores"][q]])]
    names = [f"recall@{k}" for k in ks] + [f"precision@{k}" for k in ks]
    runs = candidate_runs(a["_runs"], b["_runs"], qrels, seed)
    out["fusion"] = {
        "a": evaluate(a["_runs"]["served"], qrels, names),
        "b": evaluate(b["_runs"]["served"], qrels, names),
        "rrf": evaluate(fused_rrf, qrels, names),
        "calibrated": evaluate(runs["calibrated"], qrels, names),
        "max": evaluate(fused_max, qrels, names),
        "note": "max-score fusion compares raw cosine scores of two different models, which are not on one scale "
                "(the bad baseline); calibrated: Platt-scaled scores summed, each query calibrated on the other "
                f"{FOLDS - 1} folds",
    }
    metric = f"recall@{max(ks)}"
    hits = {name: per_query(run, qrels, metric) for name, run in runs.items()}
    out["fusion_bootstrap"] = {
        f"calibrated - rrf ({metric})": paired_bootstrap([hits["calibrated"][q] for q in qrels],
                                                        [hits["rrf"][q] for q in qrels], resamples=resamples,
                                                        seed=seed)}
    out["calibration"] = fit_calibration(a["_runs"]["served_scores"], b["_runs"]["served_scores"], qrels,
                                         sorted(qrels))
    classes = {q.query_id: q.cls for q in queries}
    out["routing"] = routing_table(runs, qrels, classes, metric, resamples, seed)
    return out


def run_evaluation(store_url: str, queries: list[LabelledQuery], alias: str = "serving", compare_to: str | None = None,
                   ks: list[int] | None = None, resamples: int = 1000, seed: int = 0, device: str = "auto",
                   traffic: str | None = None) -> dict:
    ks = sorted(set(ks or [1, 5, 10]))
    store = Location(store_url)
    a = evaluate_retriever(store, alias, queries, ks, device)
    report = {"queries": len(queries), "ks": ks, "metric": f"recall@{max(ks)}", "a": a}
    if compare_to:
        b = evaluate_retriever(store, compare_to, queries, ks, device)
        report["b"] = b
        report["compare"] = compare(a, b, queries, ks, resamples, seed)
        report["routing"] = routing_file({"a": a, "b": b}, report["compare"]["routing"],
                                         report["compare"]["calibration"], report["metric"])
        if traffic:
            report["traffic"] = {"file": traffic, **traffic_gain(report["compare"]["routing"],
                                                                 read_traffic(traffic), report["metric"])}
    for side in ("a", "b"):
        if side in report:
            report[side].pop("_runs")
    return report


evaluate_task = task(run_evaluation, name="evaluate", cache_policy=NO_CACHE)


def plot_report(store: Location, report: dict) -> dict[str, bytes]:
    """PNG plots of a report: each ANN retriever's recall sweep, and the bootstrap of A - B when compared."""
    plots = {}
    for side in ("a", "b"):
        if side in report:
            alias = read_alias(store, report[side]["alias"])
            card = read_card(store, alias["slug"], alias["version"])
            if card["search"]["param"]:
                plots[f"recall-sweep-{report[side]['alias']}"] = recall_sweep_png(card)
    if "compare" in report:
        metric = report["metric"]
        plots["bootstrap"] = bootstrap_png(report["compare"]["bootstrap"][metric], metric, report["a"]["alias"],
                                           report["b"]["alias"])
    return plots


def dumps(report: dict) -> str:
    return json.dumps(report, indent=2, default=str)


def metrics_table(report: dict) -> list[dict]:
    """One row per retriever and search (served, exact): the table artifact's rows."""
    rows = []
    for side in ("a", "b"):
        if side in report:
            r = report[side]
            for how in ("metrics", "exact"):
                rows.append({"retriever": r["alias"], "model": r["slug"], "search": r["served"] if how == "metrics"
                             else "exact", **{k: round(v, 4) for k, v in r[how].items()}})
    return rows


def write_outputs(out: str, report: dict, markdown: str, plots: dict[str, bytes]) -> None:
    """`--out DIR`: eval.json, eval.md and the PNG plots, for a pull request or a promotion gate."""
    target = Location(out)
    target.write_json("eval.json", report)
    target.write_bytes("eval.md", markdown.encode())
    if "routing" in report:  # what `imgest search --route` serves
        target.write_json("routing.json", report["routing"])
    for name, png in plots.items():
        target.write_bytes(f"{name}.png", png)
