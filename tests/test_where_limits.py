"""--where is untrusted input: one allowed expression over the metadata's columns, run under a time limit
(IMGEST_WHERE_TIMEOUT_S) and a memory limit (IMGEST_WHERE_MEMORY); each refusal is one line naming the
rule or the limit."""

from __future__ import annotations

import datetime
import time

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from imgest.retrieval.filters import MAX_WHERE_CHARS, MAX_WHERE_DEPTH, FilterError, matching_items

TABLE = pa.table({"item_id": ["a", "b", "c", "d"], "category": ["shoes", "shoes", "coats", None],
                  "price": [39.5, 80.0, 120.0, 10.0], "tags": [["red"], ["red", "sale"], [], None],
                  "added": [datetime.date(2026, 1, d) for d in (1, 2, 3, 4)], "row_hash": ["1", "2", "3", "4"]})


def _big(rows: int = 2_000_000) -> pa.Table:
    ids = pc.cast(pa.array(range(rows)), pa.string())
    return pa.table({"item_id": ids, "title": pc.binary_join_element_wise(ids, ids, ids, ids, "-")})


@pytest.mark.parametrize("where, expected", [
    ("category LIKE 'sh%' AND NOT category ILIKE '%X%'", ["a", "b"]),
    ("category IN ('coats', 'hats') OR price BETWEEN 5 AND 20", ["c", "d"]),
    ("CASE WHEN category IS NULL THEN price < 20 ELSE price > 100 END", ["c", "d"]),
    ("CAST(price AS INTEGER) = 80 OR price::VARCHAR = '39.5'", ["a", "b"]),
    ("list_contains(tags, 'sale') OR len(tags) = 0", ["b", "c"]),
    ("added >= DATE '2026-01-03' AND year(added) = 2026", ["c", "d"]),
    ("regexp_matches(lower(coalesce(category, 'none')), '^(coats|none)$')", ["c", "d"]),
    ("upper(category) || '!' = 'SHOES!' AND abs(price - 40) < 1", ["a"]),
])
def test_ordinary_predicates_still_run(where, expected):
    assert sorted(matching_items(TABLE, where).to_pylist()) == expected


@pytest.mark.parametrize("where, message", [
    # a cross join that would run for hours: refused before it runs
    ("item_id IN (SELECT a.item_id FROM metadata a, metadata b, metadata c, metadata d)", r"a subquery is not allowed"),
    ("EXISTS (SELECT * FROM read_csv('/etc/passwd'))", r"a subquery is not allowed"),
    ("read_csv('/etc/passwd') IS NULL", r"function read_csv\(\) is not allowed; allowed: abs, "),
    # DuckDB's memory limit does not count the strings an expression builds: repeat() is refused instead
    ("length(repeat(category, 100000000)) > 0", r"function repeat\(\) is not allowed"),
    ("lpad(category, 1000000000, 'x') = ''", r"function lpad\(\) is not allowed"),
    ("len(range(10000000000)) > 0", r"function range\(\) is not allowed"),
    ("1=1); DROP TABLE metadata; SELECT (1", r"one predicate over the metadata's columns, not statements"),
    ("1) UNION ALL SELECT 'x' FROM metadata WHERE (1", r"one predicate over the metadata's columns, not statements"),
    ("1) LIMIT 0 --", r"one predicate over the metadata's columns, not statements"),
    ("sum(price) OVER () > 1", r"window expressions are not allowed"),
    ("price = ?", r"parameter expressions are not allowed"),
    ("current_setting('threads') = '4'", r"function current_setting\(\) is not allowed"),
    ("price + " * 200 + "1 > 0", rf"nested deeper than {MAX_WHERE_DEPTH} levels"),
    ("NOT " * 5000 + "price > 1", rf"nested deeper than {MAX_WHERE_DEPTH} levels"),
])
def test_more_than_one_allowed_expression_is_refused_before_it_runs(where, message):
    started = time.monotonic()
    with pytest.raises(FilterError, match=message) as err:
        matching_items(TABLE, where)
    assert time.monotonic() - started < 2
    assert "\n" not in str(err.value) and str(err.value).startswith("--where ")


def test_a_predicate_longer_than_the_limit_is_refused():
    where = "item_id IN (" + ", ".join(f"'{n:08d}'" for n in range(MAX_WHERE_CHARS // 10)) + ")"
    with pytest.raises(FilterError, match=rf"--where of {len(where)} characters: the limit is {MAX_WHERE_CHARS}"):
        matching_items(TABLE, where)


def test_a_long_running_predicate_stops_at_the_time_limit(monkeypatch):
    """2M rows of string work takes seconds (2.2 s on 2 cores); at a 0.2 s limit it is interrupted."""
    monkeypatch.setenv("IMGEST_WHERE_TIMEOUT_S", "0.2")
    big = _big()
    started = time.monotonic()
    with pytest.raises(FilterError, match=r"stopped at the time limit of 0.2 s \(IMGEST_WHERE_TIMEOUT_S\)"):
        matching_items(big, "lower(upper(lower(title || title || title || title))) ILIKE '%a%b%c%'")
    assert time.monotonic() - started < 0.2 + 3


def test_a_memory_hungry_predicate_stops_at_the_memory_limit(monkeypatch):
    """An IN list of 9,000 ids is a hash set DuckDB builds in its own memory: over 1 MB it is refused."""
    monkeypatch.setenv("IMGEST_WHERE_MEMORY", "1MB")
    where = "item_id IN (" + ",".join(f"'{n}'" for n in range(9000)) + ")"
    with pytest.raises(FilterError, match=r"needs more than the memory limit of 1MB \(IMGEST_WHERE_MEMORY\)") as err:
        matching_items(_big(200_000), where)
    assert f"... ({len(where)} characters)" in str(err.value) and len(str(err.value)) < 400  # cut in the message
    monkeypatch.delenv("IMGEST_WHERE_MEMORY")
    assert len(matching_items(_big(200_000), where)) == 9000  # at the default limit it runs


@pytest.mark.parametrize("variable, value, message", [
    ("IMGEST_WHERE_TIMEOUT_S", "soon", r"IMGEST_WHERE_TIMEOUT_S must be a number of seconds > 0, got 'soon'"),
    ("IMGEST_WHERE_TIMEOUT_S", "0", r"IMGEST_WHERE_TIMEOUT_S must be a number of seconds > 0, got '0'"),
    ("IMGEST_WHERE_MEMORY", "lots", r"IMGEST_WHERE_MEMORY='lots' is not a DuckDB memory size such as 512MB"),
])
def test_bad_limit_settings_name_the_variable(monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(FilterError, match=message):
        matching_items(TABLE, "price > 1")
