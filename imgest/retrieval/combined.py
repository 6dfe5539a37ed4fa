"""Several retrievers answer one query: reciprocal rank fusion of aliases, and the retriever a routing table
chooses for a query class.

Each alias embeds the query with its own model, so vectors of two models are never compared: only ranks (or
calibrated scores) are combined. The functions here take searchers already open (`imgest search` opens them
per call, the service keeps them loaded and swaps them as the aliases move)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from imgest.retrieval.filters import grouped
from imgest.retrieval.fusion import RRF_K, rrf
from imgest.retrieval.query import Hit, Query, Searcher, SearchError

Named = Sequence[tuple[str, Searcher]]  # (alias, its searcher)
Combine = Callable[[list[list[Hit]]], list[tuple[str, float]]]  # one query's lists -> (item, score) ranking


def rrf_combine(rrf_k: int = RRF_K) -> Combine:
    return lambda lists: rrf([[h.item_id for h in hits] for hits in lists], k=rrf_k)


def fuse(named: Named, queries: list[Query], k: int, combine: Combine, where: str | None = None,
         group_by: str | None = None, per_group: int = 1) -> list[list[Hit]]:
    """Search each alias deep enough, combine each query's lists into one ranking, group it if asked. Each hit
    says which aliases found it, at which rank (`found_by`); with RRF its score is the RRF score. An alias
    whose model cannot read a query (a text query to an image-only model) sits that query out, so captions
    and images fuse in one request; a query that no alias can read is refused with the first one's reason."""
    depth = max(k, 100) * (4 * per_group if group_by else 1)
    per_alias = []
    readable = [[_reads(searcher, q) for q in queries] for _, searcher in named]
    for q, query in enumerate(queries):
        if not any(can[q] for can in readable):
            named[0][1].modality(query)  # raises: why the first alias cannot read it
    for (_, searcher), can in zip(named, readable):
        rows = [q for q, ok in enumerate(can) if ok]
        found = searcher.search([queries[q] for q in rows], depth, where) if rows else []
        results: list[list[Hit]] = [[] for _ in queries]
        for q, hits in zip(rows, found):
            results[q] = hits
        per_alias.append(results)
    uris = {h.item_id: h.uri for results in per_alias for hits in results for h in hits}
    group_of = named[0][1].groups(group_by) if group_by else None
    fused = []
    for q in range(len(queries)):
        lists = [results[q] for results in per_alias]
        ranks = [{h.item_id: h.rank for h in hits} for hits in lists]
        hits = [Hit(rank, item, uris[item], score,
                    found_by=[(alias, seen[item]) for (alias, _), seen in zip(named, ranks) if item in seen])
                for rank, (item, score) in enumerate(combine(lists), 1)]
        fused.append(grouped(hits, group_of, k, per_group)[0] if group_of is not None else hits[:k])
    return fused


def _reads(searcher: Searcher, query: Query) -> bool:
    try:
        searcher.modality(query)
    except SearchError:
        return False
    return True


@dataclass
class Route:
    """What answers a query of one class: one alias alone, or several combined."""

    aliases: tuple[str, ...]
    combine: Combine | None  # None: the one alias answers alone
    how: dict | None  # how several were chosen and combined, said with the results (None: one alias asked)


def fusion(aliases: Sequence[str], fuse: str | None, rrf_k: int = RRF_K) -> Route:
    """Which aliases answer and how, as `imgest search` and the service take them: one alias alone, or with
    `fuse="rrf"` several (one alias with it fuses serving and shadow, the pair of a migration window)."""
    if fuse is None:
        if len(aliases) > 1:
            raise SearchError(f"{len(aliases)} aliases given: add fuse rrf (--fuse rrf) to fuse them, or give one")
        return Route(tuple(aliases), None, None)
    if fuse != "rrf":
        raise SearchError(f"unknown fusion {fuse!r}; allowed: rrf")
    names = tuple(aliases) if len(aliases) > 1 else ("serving", "shadow")
    return Route(names, rrf_combine(rrf_k), {"fuse": "rrf", "rrf_k": rrf_k, "aliases": list(names)})


CAPTIONS = "captions"  # the alias of a store's caption retriever (docs/catalogue-text.md)


def text_to_captions(route: Route, queries: Sequence[Query],
                     modalities_of: Callable[[str], tuple[str, ...] | None]) -> Route:
    """Text queries asked of one alias whose model has no text tower go to the store's caption retriever when
    it has one (the `captions` alias on a text model), and the answer's `how` says so; otherwise the route is
    as it was (and the image-only model refuses the text, naming why). `modalities_of(alias)`: the modalities
    of the model an alias serves, None where the store has no such alias."""
    if route.combine is not None or len(route.aliases) != 1 or not queries or \
            any(q.text is None for q in queries):
        return route
    asked = route.aliases[0]
    served = modalities_of(asked) if asked != CAPTIONS else None
    if served is None or "text" in served or "text" not in (modalities_of(CAPTIONS) or ()):
        return route
    return Route((CAPTIONS,), None, {"route": CAPTIONS, "aliases": [CAPTIONS], "asked": asked,
                                     "from": f"{asked} has no text tower: the caption retriever answers"})


def read_route(url: str) -> dict:
    """A routing table written by `imgest eval --compare ... --out DIR` (routing.json), size-limited and checked
    field by field (routing.read_routing)."""
    from imgest.retrieval.routing import RoutingError, read_routing

    try:
        return read_routing(url)
    except RoutingError as exc:
        raise SearchError(str(exc)) from exc


def choose(route: dict, query_class: str | None, source: str = "routing table") -> Route:
    """The query class's winner in a routing table (A, B, their RRF or their calibrated fusion); the table's
    default for a class it does not name."""
    from imgest.retrieval.routing import calibrated_fusion

    chosen = route["classes"].get(query_class) if query_class else None
    how = {"route": chosen or route["default"], "query_class": query_class,
           "from": "routing table" if chosen else "default (class not in the table)" if query_class
           else "default (no --query-class)"}
    pair = (route["a"], route["b"])
    if how["route"] in ("a", "b"):
        alias = route[how["route"]]
        return Route((alias,), None, {**how, "aliases": [alias]})
    if how["route"] == "rrf":
        return Route(pair, rrf_combine(), {**how, "aliases": list(pair)})
    if how["route"] != "calibrated":
        raise SearchError(f"{source}: unknown route {how['route']!r}")
    params = [tuple(route["calibration"]["a"]), tuple(route["calibration"]["b"])]
    combine = lambda lists: calibrated_fusion([[(h.item_id, h.score) for h in hits] for hits in lists], params)  # noqa: E731
    return Route(pair, combine, {**how, "aliases": list(pair)})


def answer(named: Named, queries: list[Query], k: int, combine: Combine | None, where: str | None = None,
           group_by: str | None = None, per_group: int = 1) -> list[list[Hit]]:
    """The one searcher's hits, or the fusion of several."""
    if combine is None:
        if len(named) != 1:
            raise SearchError(f"{len(named)} aliases given: fuse them (rrf), or give one")
        return named[0][1].search(queries, k, where, group_by, per_group)
    return fuse(named, queries, k, combine, where, group_by, per_group)


def fused_search(store_url: str, queries: list[Query], k: int = 10, aliases: tuple[str, ...] = ("serving", "shadow"),
                 rrf_k: int = RRF_K, device: str = "auto", where: str | None = None, group_by: str | None = None,
                 per_group: int = 1) -> tuple[list[list[Hit]], dict[str, str | None]]:
    """Reciprocal rank fusion of several aliases (a caption index and an image index; serving and shadow
    during a migration window). `where` filters every retriever; `group_by` groups the fused ranking. Returns the
    hits and, per alias, what encoded its queries ("openvino fp32")."""
    named = [(alias, Searcher(store_url, alias=alias, device=device)) for alias in aliases]
    hits = fuse(named, queries, k, rrf_combine(rrf_k), where, group_by, per_group)
    return hits, {alias: searcher.query_encoded_by for alias, searcher in named}


def routed_search(store_url: str, queries: list[Query], k: int, route_url: str, query_class: str | None,
                  device: str = "auto", where: str | None = None, group_by: str | None = None,
                  per_group: int = 1) -> tuple[list[list[Hit]], dict]:
    """Serve a routing table: the query class's winner, and how it was chosen (with, per alias, what encoded its
    queries)."""
    route = choose(read_route(route_url), query_class, route_url)
    named = [(alias, Searcher(store_url, alias=alias, device=device)) for alias in route.aliases]
    hits = answer(named, queries, k, route.combine, where, group_by, per_group)
    return hits, {**route.how, "query_encoded_by": {alias: searcher.query_encoded_by for alias, searcher in named}}
