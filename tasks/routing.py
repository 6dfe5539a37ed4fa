"""Deciding between two retrievers per query class: calibrated score fusion, a routing table, and the
traffic-weighted gain of adding the second retriever.

Calibration: the raw scores of two models are not on one scale (why max-score fusion is the bad baseline),
so each retriever's score is mapped to the probability that a hit is relevant by Platt scaling (a logistic
regression on the score, fitted on the judged queries' ranked lists; scikit-learn). It is chosen over
isotonic regression because it has two parameters per retriever: stable with the few hundred judged
queries a team has, and monotone, so it never reorders one retriever's own list. The fused score of an item
is the sum of its calibrated probabilities (CombSUM; absent from a list: 0). Evaluated honestly, the
calibration of each query comes from the other folds (5-fold cross-fitting by query), never from itself.

Routing: per query class, the candidate (A, B, RRF of both, calibrated fusion) with the best mean of the
metric; its paired-bootstrap interval against A says whether the difference is real. The traffic gain is
the seed's arithmetic: share of traffic x per-class gain of the route over A, summed.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import numpy as np

from imgest.storage import read_url
from imgest.tasks.fusion import rrf
from imgest.tasks.metrics import paired_bootstrap, per_query

CANDIDATES = ("a", "b", "rrf", "calibrated")
FOLDS = 5


class RoutingError(ValueError):
    """A routing table or traffic file that cannot be used; the message says why."""


def platt_fit(scores: list[float], labels: list[int]) -> tuple[float, float]:
    """(slope, intercept) of P(relevant | score); a constant fit when only one label occurs."""
    from sklearn.linear_model import LogisticRegression

    if len(set(labels)) < 2:
        p = min(max(float(np.mean(labels)) if labels else 0.0, 1e-6), 1 - 1e-6)
        return 0.0, float(np.log(p / (1 - p)))
    model = LogisticRegression(C=1e4).fit(np.asarray(scores, np.float64).reshape(-1, 1), np.asarray(labels))
    return float(model.coef_[0][0]), float(model.intercept_[0])


def platt(params: tuple[float, float], score: float) -> float:
    slope, intercept = params
    return float(1.0 / (1.0 + np.exp(-(slope * score + intercept))))


def _pairs(score_runs: dict, qrels: dict, queries: list[str]) -> tuple[list[float], list[int]]:
    scores, labels = [], []
    for q in queries:
        for item, score in score_runs[q]:
            scores.append(score)
            labels.append(int(item in qrels[q]))
    return scores, labels


def fit_calibration(a_scores: dict, b_scores: dict, qrels: dict, queries: list[str]) -> dict:
    return {"a": platt_fit(*_pairs(a_scores, qrels, queries)), "b": platt_fit(*_pairs(b_scores, qrels, queries))}


Scored = list[tuple[str, float]]


def calibrated_fusion(lists: list[Scored], params: list[tuple[float, float]]) -> Scored:
    fused: dict[str, float] = defaultdict(float)
    for pairs, p in zip(lists, params):
        for item, score in pairs:
            fused[item] += platt(p, score)
    return sorted(fused.items(), key=lambda kv: (-kv[1], kv[0]))


def cross_fitted(a_scores: dict, b_scores: dict, qrels: dict, seed: int = 0) -> dict[str, list[str]]:
    """The calibrated-fusion run, each query fused with a calibration fitted on the other folds."""
    queries = sorted(qrels)
    rng = np.random.default_rng(seed)
    fold = {q: int(f) for q, f in zip(queries, rng.permutation(len(queries)) % FOLDS)}
    run = {}
    for f in range(FOLDS):
        train = [q for q in queries if fold[q] != f]
        params = fit_calibration(a_scores, b_scores, qrels, train)
        for q in (q for q in queries if fold[q] == f):
            run[q] = [item for item, _ in calibrated_fusion([a_scores[q], b_scores[q]], [params["a"], params["b"]])]
    return run


def candidate_runs(a: dict, b: dict, qrels: dict, seed: int = 0) -> dict[str, dict[str, list[str]]]:
    """Each candidate's ranked lists: A, B, their RRF, their cross-fitted calibrated fusion."""
    a_run, b_run = a["served"], b["served"]
    return {"a": a_run, "b": b_run,
            "rrf": {q: [d for d, _ in rrf([a_run[q], b_run[q]])] for q in qrels},
            "calibrated": cross_fitted(a["served_scores"], b["served_scores"], qrels, seed)}


def routing_table(runs: dict, qrels: dict, classes: dict[str, str | None], metric: str, resamples: int = 1000,
                  seed: int = 0) -> dict:
    """Per class: each candidate's mean metric, the winner, and the winner minus A with its interval."""
    hits = {name: per_query(run, qrels, metric) for name, run in runs.items()}
    by_class: dict[str, list[str]] = defaultdict(list)
    for q in qrels:
        by_class[classes.get(q) or "_all"].append(q)
    table = {}
    for cls, qs in sorted(by_class.items()):
        means = {name: float(np.mean([hits[name][q] for q in qs])) for name in runs}
        route = max(CANDIDATES, key=lambda name: (round(means[name], 12), -CANDIDATES.index(name)))
        boot = paired_bootstrap([hits["a"][q] for q in qs], [hits[route][q] for q in qs], resamples=resamples,
                                seed=seed)  # mean(route) - mean(a)
        boot.pop("samples")
        table[cls] = {"queries": len(qs), "route": route, metric: means, "route_minus_a": boot}
    return table


def read_traffic(url: str) -> dict[str, float]:
    """Class shares of a query log: JSON {class: count} or JSONL lines with a "class" field."""
    text = read_url(url).decode()
    try:
        counts = json.loads(text)
        if isinstance(counts, dict):
            counts = {str(k): float(v) for k, v in counts.items()}
        else:
            raise ValueError
    except ValueError:
        counts = Counter()
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    counts[str(json.loads(line)["class"])] += 1
                except (ValueError, KeyError, TypeError) as exc:
                    raise RoutingError(f"{url} line {number}: expected a JSON object with a 'class'") from exc
    total = sum(counts.values())
    if total <= 0:
        raise RoutingError(f"{url}: no traffic counted")
    return {cls: n / total for cls, n in counts.items()}


def traffic_gain(table: dict, shares: dict[str, float], metric: str) -> dict:
    """Share of traffic x (route - A) per class, summed; classes the query set lacks are said, not guessed."""
    rows, gain, covered = [], 0.0, 0.0
    for cls, share in sorted(shares.items(), key=lambda kv: -kv[1]):
        if cls not in table:
            rows.append({"class": cls, "share": share, "route": None, "gain": None})
            continue
        entry = table[cls]
        delta = entry[metric][entry["route"]] - entry[metric]["a"]
        rows.append({"class": cls, "share": share, "route": entry["route"], "gain": delta})
        gain += share * delta
        covered += share
    return {"metric": metric, "weighted_gain": gain, "traffic_covered": covered, "classes": rows}


def routing_file(report: dict, table: dict, calibration: dict, metric: str) -> dict:
    """What `imgest search --route` serves: per class the route, the aliases, the calibration fitted on
    every judged query, and a default (the best candidate over all queries) for classes not in the set."""
    overall = defaultdict(float)
    total = sum(entry["queries"] for entry in table.values())
    for entry in table.values():
        for name in CANDIDATES:
            overall[name] += entry[metric][name] * entry["queries"] / total
    return {"metric": metric, "a": report["a"]["alias"], "b": report["b"]["alias"],
            "models": {"a": report["a"]["model_id"], "b": report["b"]["model_id"]},
            "calibration": {"method": "platt", **{k: list(v) for k, v in calibration.items()}},
            "classes": {cls: entry["route"] for cls, entry in table.items()},
            "default": max(CANDIDATES, key=lambda name: overall[name]), "query_set": report.get("query_file")}
