"""Filtered search over catalogue metadata: a `--where` predicate to an id set, searched with faiss's ID
selectors, never under-filled; and `--group-by` (one product, however many photos, fills one result).

The predicate is SQL evaluated by DuckDB over the served version's metadata file
(imgest/retrieval/item_metadata.py: DuckDB reads the columns it names), in a connection that cannot read or
write files (`enable_external_access = false`), wrapped as one parenthesised WHERE clause, so it can filter
rows and nothing else. The ids it selects are searched at the served ANN parameters first;
where the index kind can miss selected items at those parameters (a selective filter under HNSW or IVF),
the search widens (every IVF list; a larger efSearch), and as a last step compares the query with every
selected vector: the k results satisfy the predicate whenever k items do.

A predicate is untrusted input, so it is one expression over the metadata's columns and nothing more:
DuckDB's own parser (`json_serialize_sql`) gives its syntax tree, and a subquery, a window, a lambda, a
parameter or a function off the `ALLOWED_FUNCTIONS` list (comparisons, LIKE and regexp matching, text,
number, date and list tests) is refused before anything runs. The list leaves out what can make more data
than it reads (`repeat`, `lpad`, `range`, `printf`, `regexp_replace`, ...): DuckDB's memory limit counts
its buffers, not the strings and lists an expression builds, so such a function could exhaust the
machine's memory under any limit. What runs, runs bounded:

- time: `IMGEST_WHERE_TIMEOUT_S` seconds (default 10), then the query is interrupted (`con.interrupt()`);
- memory: `IMGEST_WHERE_MEMORY` (default `512MB`, any DuckDB size such as `2GB`), DuckDB's `memory_limit`,
  with no temporary directory to spill to;
- `WHERE_THREADS` threads, `MAX_WHERE_CHARS` characters, `MAX_WHERE_DEPTH` levels of nesting.
"""

from __future__ import annotations

import json
import os
import threading

import numpy as np

DEFAULT_WHERE_TIMEOUT_S = 10.0
DEFAULT_WHERE_MEMORY = "512MB"
WHERE_THREADS = 2  # a predicate scans one table; more threads would only take cores from the search
MAX_WHERE_CHARS = 100_000  # room for an IN list of a few thousand ids
MAX_WHERE_DEPTH = 100  # DuckDB's max_expression_depth (its default, 1000, nests past Python's JSON parser)

# Functions whose result is no larger than their arguments (or a boolean / number); operators by their
# DuckDB names (`~~` is LIKE, `~~*` ILIKE, `~~~` GLOB, `^@` starts-with).
ALLOWED_FUNCTIONS = frozenset({
    "+", "-", "*", "/", "//", "%", "^", "**", "||", "~~", "!~~", "~~*", "!~~*", "~~~", "!~~~", "^@", "@>", "<@",
    "&&", "concat", "lower", "upper", "lcase", "ucase", "length", "len", "strlen", "char_length",
    "character_length", "octet_length", "trim", "ltrim", "rtrim", "substring", "substr", "left", "right",
    "contains", "starts_with", "prefix", "ends_with", "suffix", "strpos", "instr", "position", "regexp_matches",
    "regexp_full_match", "like_escape", "not_like_escape", "ilike_escape", "not_ilike_escape", "strip_accents",
    "abs", "round", "floor", "ceil", "ceiling", "sign", "sqrt", "ln", "log", "log10", "log2", "pow", "power",
    "greatest", "least", "isnan", "isinf", "isfinite", "nullif", "ifnull", "trunc", "year", "month", "day",
    "dayofweek", "dayofyear", "week", "quarter", "hour", "minute", "second", "date_part", "datepart",
    "date_trunc", "datetrunc", "date_diff", "datediff", "epoch", "current_date", "today", "now",
    "get_current_timestamp", "strptime", "try_strptime", "to_years", "to_months", "to_weeks", "to_days",
    "to_hours", "to_minutes", "to_seconds", "list_contains", "list_has", "array_contains", "array_has",
    "list_has_any", "array_has_any", "list_has_all", "array_has_all", "list_position", "list_indexof",
    "array_position", "array_indexof", "list_value", "list_pack", "struct_pack", "row", "struct_extract",
    "list_extract", "list_element", "array_extract", "array_length", "cardinality", "map_extract", "element_at",
})
# Expression kinds a predicate may hold; FUNCTION is further checked against ALLOWED_FUNCTIONS.
ALLOWED_EXPRESSIONS = frozenset({"BETWEEN", "CASE", "CAST", "COLLATE", "COLUMN_REF", "COMPARISON", "CONJUNCTION",
                                 "CONSTANT", "FUNCTION", "OPERATOR", "TYPE"})


class FilterError(ValueError):
    """A --where or --group-by that cannot be evaluated; the message says why in one line."""


def _limits() -> tuple[float, str]:
    raw = os.environ.get("IMGEST_WHERE_TIMEOUT_S", "")
    try:
        timeout = float(raw) if raw.strip() else DEFAULT_WHERE_TIMEOUT_S
        if not timeout > 0:
            raise ValueError
    except ValueError:
        raise FilterError(f"IMGEST_WHERE_TIMEOUT_S must be a number of seconds > 0, got {raw!r}") from None
    return timeout, os.environ.get("IMGEST_WHERE_MEMORY", "").strip() or DEFAULT_WHERE_MEMORY


def _refusal(con, sql: str, selected: str = "item_id") -> str | None:
    """Why `sql` (the predicate inside its SELECT of `selected`) is more than one allowed expression, or None."""
    serialized = con.execute("SELECT json_serialize_sql(?)", [sql]).fetchall()[0][0]
    try:
        tree = json.loads(serialized)
    except RecursionError:  # cannot happen under max_expression_depth; kept so it can never be a traceback
        return f"nested deeper than {MAX_WHERE_DEPTH} levels"
    if tree.get("error"):
        return None  # a syntax error: DuckDB says where when the query is bound, below
    statements = tree.get("statements") or [{}]
    node = statements[0].get("node") or {}
    select = node.get("select_list") or [{}]
    source = node.get("from_table") or {}
    if (len(statements) != 1 or node.get("type") != "SELECT_NODE" or node.get("modifiers")
            or (node.get("cte_map") or {}).get("map") or node.get("group_expressions") or node.get("group_sets")
            or node.get("having") or node.get("qualify") or node.get("sample") or len(select) != 1
            or select[0].get("column_names") != [selected] or source.get("type") != "BASE_TABLE"
            or source.get("table_name") != "metadata" or source.get("alias")):
        return "one predicate over the metadata's columns, not statements"
    todo = [node.get("where_clause")]
    while todo:  # iterative: the depth is bounded by DuckDB's parser, but no recursion is needed
        item = todo.pop()
        if isinstance(item, list):
            todo.extend(item)
        elif isinstance(item, dict):
            kind = item.get("class")
            if kind == "SUBQUERY":
                return "a subquery is not allowed (one predicate over the metadata's columns)"
            if kind is not None and kind not in ALLOWED_EXPRESSIONS:
                return f"{kind.lower().replace('_', ' ')} expressions are not allowed"
            name = str(item.get("function_name", "")).lower()
            if kind == "FUNCTION" and name not in ALLOWED_FUNCTIONS:
                return (f"function {name}() is not allowed; allowed: "
                        f"{', '.join(sorted(f for f in ALLOWED_FUNCTIONS if f[0].isalpha()))}")
            todo.extend(item.values())
    return None


def _shown(where: str) -> str:
    """The predicate as a message quotes it: a long IN list is cut, so the error stays readable."""
    return repr(where) if len(where) <= 200 else repr(where[:200]) + f"... ({len(where)} characters)"


def _interrupt(con) -> None:
    import duckdb

    try:
        con.interrupt()
    except duckdb.Error:  # the query ended and the connection closed as the timer fired
        pass


def matching_items(table, where: str, select: str = "item_id", hidden: tuple[str, ...] = ("row_hash",)):
    """The `select` column (item_ids; an Arrow array) of the metadata rows that satisfy `where` (DuckDB SQL over
    its columns; `hidden` ones are left out of messages). DuckDB reads the columns the predicate names and
    `select`, no others.

    Raises FilterError, one line, for a predicate that is not one allowed expression, a bad column or
    syntax, or one that runs past the time or memory limit (the module docstring lists them)."""
    import duckdb

    columns = ", ".join(c for c in table.column_names if c not in hidden)
    if len(where) > MAX_WHERE_CHARS:
        raise FilterError(f"--where of {len(where)} characters: the limit is {MAX_WHERE_CHARS}")
    timeout, memory = _limits()
    sql = f"SELECT {select} FROM metadata WHERE ({where})"
    try:
        con = duckdb.connect(config={
            "enable_external_access": False, "memory_limit": memory,
            "temp_directory": "", "threads": WHERE_THREADS, "max_expression_depth": MAX_WHERE_DEPTH,
            "lock_configuration": True})
    except duckdb.Error as exc:
        raise FilterError(f"IMGEST_WHERE_MEMORY={memory!r} is not a DuckDB memory size such as 512MB or 2GB "
                          f"({str(exc).strip().splitlines()[0]})") from exc
    timer = threading.Timer(timeout, _interrupt, (con,))
    try:
        statements = con.extract_statements(sql)
        if len(statements) != 1 or statements[0].type != duckdb.StatementType.SELECT:
            raise FilterError(f"--where {_shown(where)}: one predicate over the metadata's columns, not statements")
        refusal = _refusal(con, sql, select)
        if refusal:
            raise FilterError(f"--where {_shown(where)}: {refusal} (columns: {columns})")
        con.register("metadata", table)
        timer.start()
        return con.sql(sql).to_arrow_table().column(select).combine_chunks()
    except duckdb.InterruptException as exc:
        raise FilterError(f"--where {_shown(where)}: stopped at the time limit of {timeout:g} s "
                          "(IMGEST_WHERE_TIMEOUT_S)") from exc
    except duckdb.OutOfMemoryException as exc:
        raise FilterError(f"--where {_shown(where)}: needs more than the memory limit of {memory} "
                          "(IMGEST_WHERE_MEMORY)") from exc
    except duckdb.Error as exc:
        first = str(exc).strip().splitlines()[0]
        if "expression depth" in first:  # DuckDB's hint (SET max_expression_depth) is not the user's to follow
            first = f"nested deeper than {MAX_WHERE_DEPTH} levels"
        raise FilterError(f"--where {_shown(where)}: {first} (columns: {columns})") from exc
    finally:
        timer.cancel()
        con.close()


def positions(items, index_ids) -> np.ndarray:
    """faiss ids (positions in `index_ids`, an Arrow array of the index's item_ids) of `items`; items the
    index does not hold are dropped."""
    import pyarrow.compute as pc

    found = pc.index_in(items, value_set=index_ids)
    return found.drop_null().to_numpy(zero_copy_only=False).astype(np.int64)


def _params(index, bits: np.ndarray, param: str | None, value: int | None, k_factor: int | None = None):
    import faiss

    selector = faiss.IDSelectorBitmap(index.ntotal, faiss.swig_ptr(bits))  # 1 bit per id: cheap at any size
    inner = faiss.downcast_index(index)
    if param == "efSearch":
        params = faiss.SearchParametersHNSW(sel=selector, efSearch=int(value))
    elif param == "nprobe":
        params = faiss.SearchParametersIVF(sel=selector, nprobe=int(value))
    else:
        params = faiss.SearchParameters(sel=selector)
    if isinstance(inner, faiss.IndexRefine):  # PQ candidates re-ranked: the selector goes to the PQ search
        base = faiss.downcast_index(inner.base_index)
        if isinstance(base, faiss.IndexPreTransform):
            params = faiss.SearchParametersPreTransform(index_params=params)
        params = faiss.IndexRefineSearchParameters(k_factor=float(k_factor or 1), base_index_params=params,
                                                   sel=selector)
    elif isinstance(inner, faiss.IndexPreTransform):  # OPQ in front of an IVF: the selector goes to the IVF
        params = faiss.SearchParametersPreTransform(index_params=params)
    return params, selector  # the selector must outlive the search


def _widened(index, param: str | None, value: int | None, k: int) -> int | None:
    import faiss

    if param == "nprobe":
        return faiss.extract_index_ivf(index).nlist
    if param == "efSearch":
        return max(int(value), min(index.ntotal, 64 * k))
    return value


def _exact_over(index, vectors: np.ndarray, allowed: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Inner products with every selected vector (reconstructed from the index: exact for flat storage,
    the quantised value for SQ and PQ codes)."""
    stored = index.reconstruct_batch(allowed)
    scores = vectors @ stored.T
    top = np.argsort(-scores, axis=1)[:, :k]
    return np.take_along_axis(scores, top, axis=1), allowed[top]


def filtered_search(index, vectors: np.ndarray, k: int, allowed: np.ndarray, param: str | None,
                    value: int | None, k_factor: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Top k among the `allowed` faiss ids for each query, filled whenever `allowed` holds k ids."""
    vectors = np.ascontiguousarray(vectors, np.float32)
    mask = np.zeros(index.ntotal, bool)
    mask[allowed] = True
    bits = np.packbits(mask, bitorder="little")  # faiss's IDSelectorBitmap: bit i of byte i // 8 is id i
    allowed = np.flatnonzero(mask)
    need = min(k, len(allowed))
    scores = np.full((len(vectors), k), -np.inf, np.float32)
    ids = np.full((len(vectors), k), -1, np.int64)
    if need == 0:
        return scores, ids
    for step, setting in enumerate((value, _widened(index, param, value, k))):
        rows = np.flatnonzero((ids >= 0).sum(axis=1) < need)
        if not len(rows) or (step and setting == value):
            break
        params, _keep = _params(index, bits, param, setting, k_factor)
        found_scores, found_ids = index.search(vectors[rows], k, params=params)
        scores[rows], ids[rows] = found_scores, found_ids
    rows = np.flatnonzero((ids >= 0).sum(axis=1) < need)
    if len(rows):
        try:
            exact_scores, exact_ids = _exact_over(index, vectors[rows], allowed, need)
        except RuntimeError as exc:  # an index that cannot reconstruct (an IVF without its direct map)
            raise FilterError(f"the filter selects {len(allowed)} items but the index returned fewer than {need} "
                              f"of them and cannot be searched exhaustively ({exc})") from exc
        scores[rows, :need], ids[rows, :need] = exact_scores, exact_ids
    return scores, ids


def grouped(hits: list, group_of, k: int, per_group: int) -> tuple[list, bool]:
    """At most `per_group` hits per group (`group_of.get(item_id)`; an item without one is its own), the first k
    groups in rank order; and whether k groups were filled."""
    kept, counts = [], {}
    for hit in hits:
        group = group_of.get(hit.item_id) or hit.item_id
        if counts.get(group, 0) >= per_group:
            continue
        if group not in counts and len(counts) == k:
            continue
        counts[group] = counts.get(group, 0) + 1
        hit.group = group
        kept.append(hit)
    for rank, hit in enumerate(kept, 1):
        hit.rank = rank
    return kept, len(counts) >= k
