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

Reading: a routing table (`routing_file`'s shape, what `imgest search --route` serves) and a traffic file
are untrusted; each is read to at most MAX_ROUTING_BYTES / MAX_TRAFFIC_BYTES (a longer one is refused
unread), parsed without NaN or Infinity, and checked field by field: every problem is one RoutingError
line naming the file and the field.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict

import numpy as np

from imgest.errors import UserError
from imgest.retrieval.fusion import rrf
from imgest.retrieval.metrics import paired_bootstrap, per_query
from imgest.storage import Location, redact

CANDIDATES = ("a", "b", "rrf", "calibrated")
FOLDS = 5
MAX_ROUTING_BYTES = 1 << 20  # a routing table: a few hundred classes take kilobytes
MAX_TRAFFIC_BYTES = 64 << 20  # a query log: about a million JSONL lines
MAX_NAME_CHARS = 1024  # an alias, a class, a metric, a model id (a local model folder's path)


class RoutingError(UserError, ValueError):
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


def _read(url: str, limit: int, what: str) -> str:
    """The text of `url`, reading at most one byte past `limit`: a longer file is refused unread."""
    try:
        data = Location(url).read_bytes("", limit=limit + 1)
    except (FileNotFoundError, IsADirectoryError) as exc:
        raise RoutingError(f"{redact(url)}: no such {what} file") from exc
    if len(data) > limit:
        raise RoutingError(f"{redact(url)}: larger than the limit of {limit} bytes for a {what} file")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise RoutingError(f"{redact(url)}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _json(text: str):
    """json.loads without NaN/Infinity; a nesting too deep for Python's parser is a ValueError like the rest."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _name(value, field: str, url: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_CHARS:
        raise RoutingError(f"{redact(url)}: {field} must be a non-empty string of at most {MAX_NAME_CHARS} "
                           f"characters, got {_shown(value)}")
    return value


def _route(value, field: str, url: str) -> str:
    if value not in CANDIDATES or not isinstance(value, str):
        raise RoutingError(f"{redact(url)}: {field} must be one of {', '.join(CANDIDATES)}, got {_shown(value)}")
    return value


def _shown(value) -> str:
    """A value as an error quotes it: its JSON type, and a short excerpt (never a deep or long structure)."""
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    kind = kinds.get(type(value), "a number")
    return kind if isinstance(value, dict | list) else f"{kind} {str(value)[:60]!r}"


def read_routing(url: str) -> dict:
    """A routing table written by `imgest eval --compare ... --out DIR` (routing.json), checked field by field
    against `routing_file`'s shape: what `imgest search --route` may rely on. Raises RoutingError, one line."""
    try:
        route = _json(_read(url, MAX_ROUTING_BYTES, "routing table"))
    except ValueError as exc:
        raise RoutingError(f"{redact(url)}: not JSON ({str(exc).splitlines()[0][:200]})") from exc
    if not isinstance(route, dict):
        raise RoutingError(f"{redact(url)}: a routing table is a JSON object (written by imgest eval --compare "
                           f"--out), got {_shown(route)}")
    missing = [key for key in ("a", "b", "classes", "default") if key not in route]
    if missing:
        raise RoutingError(f"{redact(url)}: not a routing table written by imgest eval: no {', '.join(missing)}")
    _name(route["a"], "a (the first retriever's alias)", url)
    _name(route["b"], "b (the second retriever's alias)", url)
    classes = route["classes"]
    if not isinstance(classes, dict):
        raise RoutingError(f"{redact(url)}: classes must be an object {{class: route}}, got {_shown(classes)}")
    for cls, chosen in classes.items():
        _name(cls, "a class name", url)
        _route(chosen, f"classes[{cls!r}]", url)
    _route(route["default"], "default", url)
    if "metric" in route:
        _name(route["metric"], "metric", url)
    if route.get("query_set") is not None and not isinstance(route["query_set"], str):
        raise RoutingError(f"{redact(url)}: query_set must be a string or null, got {_shown(route['query_set'])}")
    models = route.get("models", {})
    if not isinstance(models, dict):
        raise RoutingError(f"{redact(url)}: models must be an object {{a: model id, b: model id}}, got "
                           f"{_shown(models)}")
    for side, model in models.items():
        _name(model, f"models[{str(side)[:60]!r}]", url)
    if "calibrated" in (route["default"], *classes.values()) or "calibration" in route:
        _calibration(route.get("calibration"), url)
    return route


def _calibration(calibration, url: str) -> None:
    """Platt parameters of each retriever: [slope, intercept], finite numbers."""
    if not isinstance(calibration, dict):
        raise RoutingError(f"{redact(url)}: calibration must be an object {{a: [slope, intercept], b: [slope, "
                           f"intercept]}} (a route is 'calibrated'), got {_shown(calibration)}")
    if calibration.get("method", "platt") != "platt":
        raise RoutingError(f"{redact(url)}: calibration.method must be 'platt' (the only one served), got "
                           f"{_shown(calibration['method'])}")
    for side in ("a", "b"):
        params = calibration.get(side)
        if not isinstance(params, list) or len(params) != 2 or not all(_finite(p) for p in params):
            raise RoutingError(f"{redact(url)}: calibration.{side} must be [slope, intercept], two finite numbers, "
                               f"got {_shown(params)}")


def _finite(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _count(value, cls: str, url: str) -> float:
    if not _finite(value) or value < 0:
        raise RoutingError(f"{redact(url)}: the count of class {cls[:60]!r} must be a number >= 0, got "
                           f"{_shown(value)}")
    return float(value)


def read_traffic(url: str) -> dict[str, float]:
    """Class shares of a query log: JSON {class: count} or JSONL lines with a "class" field."""
    text = _read(url, MAX_TRAFFIC_BYTES, "traffic")
    try:
        counts = _json(text)
    except ValueError:
        counts = None
    if isinstance(counts, dict) and _finite(counts.get("class", 0)):
        # {class: count}; a one-line log ({"class": "text", ...}) is a JSON object too, read below as a log
        counts = {_name(cls, "a class name", url): _count(n, cls, url) for cls, n in counts.items()}
    else:
        counts = Counter()
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    cls = _json(line)["class"]
                    if not isinstance(cls, str | int) or isinstance(cls, bool):
                        raise TypeError
                except (ValueError, KeyError, TypeError, IndexError) as exc:
                    raise RoutingError(f"{redact(url)} line {number}: expected a JSON object with a 'class' "
                                       "(a string)") from exc
                counts[_name(str(cls), f"line {number}: class", url)] += 1
    total = sum(counts.values())
    if total <= 0:
        raise RoutingError(f"{redact(url)}: no traffic counted")
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
