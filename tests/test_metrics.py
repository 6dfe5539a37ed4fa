"""Metrics by hand, against trec_eval (pytrec_eval), the bootstrap, win/loss cells and fusion."""

import numpy as np
import pytest

from imgest.retrieval.fusion import max_score, rrf
from imgest.retrieval.metrics import evaluate, paired_bootstrap, parse_metric, per_query, win_loss

RUN = {"q1": ["x", "a", "y", "b"], "q2": ["c", "z"], "q3": ["w"]}
QRELS = {"q1": {"a", "b"}, "q2": {"c"}, "q3": {"v"}}


def test_hand_worked_values():
    # q1: first relevant at rank 2 -> recall@1 0, recall@2 1, MRR 1/2; P@2 = 1/2; P@4 = 2/4
    #     AP = (P@2 + P@4) / |R| = (1/2 + 2/4) / 2 = 0.5
    # q2: relevant at rank 1 -> everything 1 except P@2 = 1/2; AP = 1/1 = 1
    # q3: nothing relevant retrieved -> all 0
    values = evaluate(RUN, QRELS, ["recall@1", "recall@2", "precision@2", "precision@4", "mrr", "map"])
    assert values["recall@1"] == pytest.approx((0 + 1 + 0) / 3)
    assert values["recall@2"] == pytest.approx((1 + 1 + 0) / 3)
    assert values["precision@2"] == pytest.approx((0.5 + 0.5 + 0) / 3)
    assert values["precision@4"] == pytest.approx((0.5 + 0.25 + 0) / 3)
    assert values["mrr"] == pytest.approx((0.5 + 1 + 0) / 3)
    assert values["map"] == pytest.approx((0.5 + 1 + 0) / 3)
    assert per_query(RUN, QRELS, "mrr@1") == {"q1": 0.0, "q2": 1.0, "q3": 0.0}


def test_metric_names_are_checked():
    assert parse_metric("Recall@10") == ("recall", 10) and parse_metric("map") == ("map", None)
    with pytest.raises(ValueError, match="allowed: recall@K, precision@K, mrr"):
        parse_metric("ndcg@10")
    with pytest.raises(ValueError):
        parse_metric("recall")


def test_agrees_with_trec_eval_on_random_runs():
    pytrec_eval = pytest.importorskip("pytrec_eval")
    rng = np.random.default_rng(3)
    docs = [f"d{i}" for i in range(60)]
    run, qrels = {}, {}
    for q in range(40):
        ranked = list(rng.choice(docs, size=20, replace=False))
        run[f"q{q}"] = ranked
        qrels[f"q{q}"] = set(rng.choice(docs, size=int(rng.integers(1, 8)), replace=False))
    # trec_eval ranks by score: give strictly decreasing scores so both see the same order
    trec_run = {q: {d: float(len(r) - i) for i, d in enumerate(r)} for q, r in run.items()}
    trec_qrels = {q: {d: 1 for d in rel} for q, rel in qrels.items()}
    ours = evaluate(run, qrels, ["recall@1", "recall@5", "recall@10", "precision@5", "precision@10", "mrr", "map"])
    evaluator = pytrec_eval.RelevanceEvaluator(trec_qrels, {"success.1,5,10", "P.5,10", "recip_rank", "map"})
    theirs = evaluator.evaluate(trec_run)

    def mean(key):
        return float(np.mean([v[key] for v in theirs.values()]))

    pairs = {"recall@1": "success_1", "recall@5": "success_5", "recall@10": "success_10", "precision@5": "P_5",
             "precision@10": "P_10", "mrr": "recip_rank", "map": "map"}
    for mine, trec in pairs.items():
        assert ours[mine] == pytest.approx(mean(trec), abs=1e-9), mine


def test_bootstrap_is_reproducible_and_covers_a_known_difference():
    rng = np.random.default_rng(0)
    a = (rng.random(400) < 0.5).astype(float)
    b = np.where(rng.random(400) < 0.6, 1.0, a)  # b keeps a's hits and adds more: a true improvement
    first = paired_bootstrap(a, b, resamples=1000, seed=7)
    again = paired_bootstrap(a, b, resamples=1000, seed=7)
    assert first["samples"] == again["samples"] and (first["low"], first["high"]) == (again["low"], again["high"])
    assert first["difference"] == pytest.approx(b.mean() - a.mean())
    assert first["low"] < first["difference"] < first["high"] and first["low"] > 0
    same = paired_bootstrap(a, a, resamples=1000, seed=7)
    assert same["low"] == same["high"] == 0.0
    with pytest.raises(ValueError):
        paired_bootstrap([1.0], [1.0, 0.0])


def test_win_loss_cells_sum_to_the_queries():
    a = {"q1": 1.0, "q2": 1.0, "q3": 0.0, "q4": 0.0, "q5": 1.0}
    b = {"q1": 1.0, "q2": 0.0, "q3": 1.0, "q4": 0.0, "q5": 1.0}
    cells = win_loss(a, b)
    assert cells["counts"] == {"both_hit": 2, "a_only": 1, "b_only": 1, "both_miss": 1}
    assert sum(cells["counts"].values()) == cells["queries"] == 5
    assert cells["union_ceiling"] == pytest.approx(4 / 5)


def test_rrf_by_hand():
    # a: 1/61; b: 1/62 + 1/61; c: 1/63 + 1/62; d: 1/63  ->  b, c, a, d
    fused = rrf([["a", "b", "c"], ["b", "c", "d"]], k=60)
    assert [d for d, _ in fused] == ["b", "c", "a", "d"]
    assert dict(fused)["b"] == pytest.approx(1 / 62 + 1 / 61)


def test_max_score_keeps_each_items_best_score():
    fused = max_score([[("a", 0.9), ("b", 0.5)], [("b", 0.95), ("c", 0.2)]])
    assert fused == [("b", 0.95), ("a", 0.9), ("c", 0.2)]
