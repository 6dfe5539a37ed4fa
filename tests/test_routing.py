"""Routing between two retrievers: Platt calibration (cross-fitted), the per-class table with intervals,
and the traffic-weighted gain, on hand-made runs whose answers are known."""

from __future__ import annotations

import json

import numpy as np
import pytest

from imgest.tasks.routing import (
    RoutingError,
    candidate_runs,
    platt,
    platt_fit,
    read_traffic,
    routing_table,
    traffic_gain,
)


def test_platt_maps_scores_to_the_share_of_relevant_hits():
    rng = np.random.default_rng(0)
    scores = rng.uniform(0, 1, 4000)
    labels = (rng.uniform(0, 1, 4000) < scores).astype(int)  # P(relevant | s) = s
    params = platt_fit(list(scores), list(labels))
    assert abs(platt(params, 0.2) - 0.2) < 0.08 and abs(platt(params, 0.8) - 0.8) < 0.08
    assert platt(params, 0.9) > platt(params, 0.1)  # monotone: never reorders one retriever's list
    constant = platt_fit([0.1, 0.5, 0.9], [0, 0, 0])
    assert platt(constant, 0.1) == platt(constant, 0.9) < 0.01


def _runs(n_per_class=40):
    """Retriever A finds the item for 'visual' queries, B for 'text' queries; scores on different scales."""
    a, b, qrels, classes = {"served": {}, "served_scores": {}}, {"served": {}, "served_scores": {}}, {}, {}
    for cls in ("visual", "text"):
        for i in range(n_per_class):
            q, target = f"{cls}-{i}", f"item-{cls}-{i}"
            qrels[q], classes[q] = {target}, cls
            a_list = [target] + [f"x{j}" for j in range(9)] if cls == "visual" else [f"x{j}" for j in range(10)]
            b_list = [target] + [f"y{j}" for j in range(9)] if cls == "text" else [f"y{j}" for j in range(10)]
            a["served"][q], b["served"][q] = a_list, b_list
            a["served_scores"][q] = [(d, (0.9 if d == target else 0.5) - 0.01 * r) for r, d in enumerate(a_list)]
            b["served_scores"][q] = [(d, (40.0 if d == target else 10.0) - 0.1 * r) for r, d in enumerate(b_list)]
    return a, b, qrels, classes


def test_routing_sends_each_class_to_the_retriever_that_wins_it():
    a, b, qrels, classes = _runs()
    runs = candidate_runs(a, b, qrels, seed=0)
    table = routing_table(runs, qrels, classes, "recall@1", resamples=500)
    assert table["visual"]["route"] == "a" and table["text"]["route"] in ("b", "calibrated")
    assert table["text"]["route_minus_a"]["low"] > 0.5  # a real difference, its interval clear of zero
    assert table["visual"]["route_minus_a"]["difference"] == 0.0
    # calibration puts both retrievers' relevant hits first; rank fusion cannot, at k=1
    assert table["text"]["recall@1"]["calibrated"] == 1.0 and table["visual"]["recall@1"]["calibrated"] == 1.0
    assert table["text"]["recall@1"]["rrf"] < 1.0 or table["visual"]["recall@1"]["rrf"] < 1.0

    gain = traffic_gain(table, {"text": 0.25, "visual": 0.7, "other": 0.05}, "recall@1")
    per_class = {row["class"]: row for row in gain["classes"]}
    assert per_class["other"]["gain"] is None and gain["traffic_covered"] == pytest.approx(0.95)
    assert gain["weighted_gain"] == pytest.approx(0.25 * 1.0 + 0.7 * 0.0)


def test_traffic_reads_counts_or_a_query_log(tmp_path):
    (tmp_path / "counts.json").write_text(json.dumps({"text": 30, "visual": 10}))
    assert read_traffic(str(tmp_path / "counts.json")) == {"text": 0.75, "visual": 0.25}
    (tmp_path / "log.jsonl").write_text('{"class": "text"}\n{"class": "visual"}\n{"class": "text"}\n')
    assert read_traffic(str(tmp_path / "log.jsonl")) == pytest.approx({"text": 2 / 3, "visual": 1 / 3})
    (tmp_path / "bad.jsonl").write_text('{"class": "text"}\n{"query": "no class"}\n')
    with pytest.raises(RoutingError, match="bad.jsonl line 2"):
        read_traffic(str(tmp_path / "bad.jsonl"))
