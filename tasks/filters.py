"""Filtered search over catalogue metadata: a `--where` predicate to an id set, searched with faiss's ID
selectors, never under-filled; and `--group-by` (one product, however many photos, fills one result).

The predicate is SQL evaluated by DuckDB over the store's latest metadata snapshot, in a connection that
cannot read or write files (`enable_external_access = false`), wrapped as one parenthesised WHERE clause, so
it can filter rows and nothing else. The ids it selects are searched at the served ANN parameters first;
where the index kind can miss selected items at those parameters (a selective filter under HNSW or IVF),
the search widens (every IVF list; a larger efSearch), and as a last step compares the query with every
selected vector: the k results satisfy the predicate whenever k items do.
"""

from __future__ import annotations

import numpy as np


class FilterError(ValueError):
    """A --where or --group-by that cannot be evaluated; the message says why in one line."""


def matching_items(table, where: str):
    """item_ids (an Arrow array) of the metadata rows that satisfy `where` (DuckDB SQL over its columns)."""
    import duckdb

    sql = f"SELECT item_id FROM metadata WHERE ({where})"
    con = duckdb.connect(config={"enable_external_access": False, "lock_configuration": True})
    try:
        statements = con.extract_statements(sql)
        if len(statements) != 1 or statements[0].type != duckdb.StatementType.SELECT:
            raise FilterError(f"--where {where!r}: one predicate over the metadata's columns, not statements")
        con.register("metadata", table)
        return con.sql(sql).to_arrow_table().column("item_id").combine_chunks()
    except duckdb.Error as exc:
        first = str(exc).strip().splitlines()[0]
        columns = ", ".join(c for c in table.column_names if c != "row_hash")
        raise FilterError(f"--where {where!r}: {first} (columns: {columns})") from exc
    finally:
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


def grouped(hits: list, group_of: dict[str, str], k: int, per_group: int) -> tuple[list, bool]:
    """At most `per_group` hits per group (an item without one is its own), the first k groups in rank
    order; and whether k groups were filled."""
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
