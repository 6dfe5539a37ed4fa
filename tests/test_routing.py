"""Routing between two retrievers: Platt calibration (cross-fitted), the per-class table with intervals,
and the traffic-weighted gain, on hand-made runs whose answers are known; routing tables and traffic files
read as untrusted input (every malformed shape one line, through the CLI too)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from imgest.retrieval.routing import (
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


# -- reading untrusted routing tables and traffic files ------------------------------------------------------

ROUTE = {"metric": "recall@10", "a": "serving", "b": "captions",
         "models": {"a": "efficientnet-lite0", "b": "minilm-l6"},
         "calibration": {"method": "platt", "a": [4.2, -3.1], "b": [0.2, -5.0]},
         "classes": {"visual": "a", "text": "calibrated"}, "default": "rrf", "query_set": "queries.jsonl"}
DEEP = "[" * 1000 + "]" * 1000


def _with(**changes) -> str:
    route = {k: v for k, v in ROUTE.items() if k not in changes or changes[k] is not ...}
    route.update({k: v for k, v in changes.items() if v is not ...})
    return json.dumps(route)


def test_a_routing_table_from_routing_file_reads_back(tmp_path):
    from imgest.retrieval.routing import read_routing, routing_file

    report = {"a": {"alias": "serving", "model_id": "m-a"}, "b": {"alias": "captions", "model_id": "m-b"},
              "query_file": "q.jsonl"}
    table = {"visual": {"queries": 3, "route": "a", "recall@1": {n: 0.5 for n in ("a", "b", "rrf", "calibrated")}}}
    written = routing_file(report, table, {"a": (1.0, -2.0), "b": (0.5, 0.0)}, "recall@1")
    (tmp_path / "routing.json").write_text(json.dumps(written))
    assert read_routing(str(tmp_path / "routing.json")) == json.loads(json.dumps(written))


MALFORMED = {
    "list": ("[1, 2]", r"a routing table is a JSON object .*got a list"),
    "string": ('"serving"', r"a routing table is a JSON object .*got a string 'serving'"),
    "not-json": ("{'a': 1}", r"not JSON \(Expecting property name"),
    "missing": (_with(classes=..., default=...), r"not a routing table written by imgest eval: no classes, default"),
    "number-alias": (_with(a=7), r"a \(the first retriever's alias\) must be a non-empty string .*got a number '7'"),
    "classes-string": (_with(classes="visual"), r"classes must be an object \{class: route\}, got a string"),
    "classes-list": (_with(classes=["a"]), r"classes must be an object \{class: route\}, got a list"),
    "route-mapping": (_with(classes={"visual": {"route": "a"}}), r"classes\['visual'\] must be one of a, b, rrf, "
                                                                 r"calibrated, got an object"),
    "unknown-route": (_with(default="c"), r"default must be one of a, b, rrf, calibrated, got a string 'c'"),
    "no-calibration": (_with(calibration=...), r"calibration must be an object .*got null"),
    "calibration-nan": (_with(calibration={"a": [1, 2], "b": [1, "x"]}), r"calibration.b must be \[slope, "
                                                                         r"intercept\], two finite numbers"),
    "infinity": (_with().replace("4.2", "Infinity"), r"not JSON \(Infinity is not a number JSON allows"),
    "huge-number": (_with().replace("4.2", "1e400"), r"calibration.a must be \[slope, intercept\]"),
    "models-number": (_with(models=3), r"models must be an object"),
    "nested-1000": ('{"a": ' + DEEP + ', "b": "x", "classes": {}, "default": "a"}',
                    r"(a \(the first retriever's alias\) must be .*got a list|nested too deeply)"),
    "nested-100000": ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", r"not JSON \(nested too deeply\)"),
    "not-utf8": (b"\xff\xfe{}", r"not UTF-8 text"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_routing_table_is_one_routing_error(tmp_path, name):
    from imgest.retrieval.routing import read_routing

    content, message = MALFORMED[name]
    path = tmp_path / "route.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(RoutingError, match=message) as err:
        read_routing(str(path))
    assert str(err.value).startswith(str(path)) and "\n" not in str(err.value)


def test_a_routing_table_over_the_size_limit_is_refused_unread(tmp_path):
    from imgest.retrieval.routing import MAX_ROUTING_BYTES, read_routing

    big = _with(classes={f"class-{n}": "a" for n in range(MAX_ROUTING_BYTES // 16)})
    (tmp_path / "route.json").write_text(big)
    with pytest.raises(RoutingError, match=rf"larger than the limit of {MAX_ROUTING_BYTES} bytes"):
        read_routing(str(tmp_path / "route.json"))


@pytest.mark.parametrize("name", ["list", "string", "missing", "number-alias", "classes-string", "route-mapping",
                                  "calibration-nan", "nested-1000", "nested-100000"])
def test_search_with_a_malformed_routing_table_exits_2_with_one_line(tmp_path, name):
    """The table is read before the store is opened: no store is needed to see the refusal."""
    from typer.testing import CliRunner

    from imgest.cli import app

    content, message = MALFORMED[name]
    (tmp_path / "route.json").write_text(content)
    result = CliRunner().invoke(app, ["search", "--store", str(tmp_path / "store"), "--text", "red shoes",
                                      "--route", str(tmp_path / "route.json")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("imgest: error: ") and "Traceback" not in result.output
    assert re.search(message, lines[0]), lines[0]


@pytest.mark.parametrize("content, message", [
    ('{"text": "many"}', r"the count of class 'text' must be a number >= 0, got a string 'many'"),
    ('{"text": {"n": 1}}', r"the count of class 'text' must be a number >= 0, got an object"),
    ('{"text": -3, "visual": 4}', r"the count of class 'text' must be a number >= 0"),
    ('{"text": 1e400}', r"the count of class 'text' must be a number >= 0, got a number 'inf'"),
    ('{"text": 0}', r"no traffic counted"),
    ('[1, 2]', r"line 1: expected a JSON object with a 'class'"),
    ('{"class": "text"}\n{"class": ["visual"]}\n', r"line 2: expected a JSON object with a 'class' \(a string\)"),
    ('{"class": "text"}\n' + "[" * 100_000 + "\n", r"line 2: expected a JSON object with a 'class'"),
    (b"\xff{}", r"not UTF-8 text"),
])
def test_a_malformed_traffic_file_is_one_routing_error(tmp_path, content, message):
    path = tmp_path / "traffic.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(RoutingError, match=message) as err:
        read_traffic(str(path))
    assert "\n" not in str(err.value)


def test_eval_refuses_a_malformed_traffic_file_before_a_run_starts(tmp_path):
    from typer.testing import CliRunner

    from imgest.cli import app

    (tmp_path / "q.jsonl").write_text('{"query_id": "q1", "text": "red", "relevant": ["a.jpg"]}\n')
    (tmp_path / "traffic.json").write_text("[1, 2]")
    result = CliRunner().invoke(app, ["eval", "--store", str(tmp_path / "store"), "--queries",
                                      str(tmp_path / "q.jsonl"), "--compare", "captions", "--traffic",
                                      str(tmp_path / "traffic.json")])
    assert result.exit_code == 2, result.output
    assert "expected a JSON object with a 'class'" in result.output and "Traceback" not in result.output


def test_a_one_line_log_and_a_class_named_class_still_read(tmp_path):
    (tmp_path / "one.jsonl").write_text('{"class": "text", "query": "red shoes"}\n')
    assert read_traffic(str(tmp_path / "one.jsonl")) == {"text": 1.0}
    (tmp_path / "counts.json").write_text('{"class": 1, "text": 3}')
    assert read_traffic(str(tmp_path / "counts.json")) == {"class": 0.25, "text": 0.75}
