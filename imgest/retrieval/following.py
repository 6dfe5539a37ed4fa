"""Searchers that follow their aliases: a long-lived reader (a service, a team's own process) keeps answering
while nightly, promote, rollback and finish move the aliases under it.

Each alias is served by one loaded Searcher. `refresh()` reads each alias record (one small GET) and, when it
names another version, loads that version beside the old one (its checksum verified by open_index) and swaps
the reference; a query that took the old Searcher finishes on it, and the old one is freed when no query holds
it. A version that fails to load leaves the old one serving, and the failure is kept in `status()`.
`follow(every=)` refreshes from a background thread; tests call `refresh()` directly.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np

from imgest.redact import one_line
from imgest.retrieval.combined import answer, choose, fusion, text_to_captions
from imgest.retrieval.fusion import RRF_K
from imgest.retrieval.query import Hit, Query, Searcher, SearchError
from imgest.state.aliases import read_alias
from imgest.storage import open_location


@dataclass
class Answer:
    """What answered a request: the hits per query, and the model and version each alias asked served."""

    hits: list[list[Hit]]
    served: dict[str, tuple[str, int]]  # alias -> (model slug, index version), the request's first alias first
    how: dict | None = None  # a fusion or a routing table's choice, as `imgest search --json` says it
    metadata: dict[str, dict] | None = None  # with_metadata: each hit's catalogue metadata row by item_id
    query_encoded_by: dict[str, str | None] | None = None  # alias -> what encoded its queries ("openvino fp32")

    @property
    def alias(self) -> str:
        return next(iter(self.served))

    @property
    def model(self) -> str:
        return self.served[self.alias][0]

    @property
    def version(self) -> int:
        return self.served[self.alias][1]

    def source(self, hit: Hit) -> str:
        """The alias a hit is credited to: the one alias asked, or among fused ones the one ranking it best."""
        if not hit.found_by:
            return self.alias
        return min(hit.found_by, key=lambda pair: pair[1])[0]


@dataclass
class _Served:
    searcher: Searcher
    slug: str
    version: int
    loaded_at: str


class FollowingSearcher:
    def __init__(self, store_url: str, aliases: tuple[str, ...] = ("serving",), device: str = "auto",
                 route: dict | None = None):
        self.store = open_location(store_url, must_exist=True, what="store")
        self.route = route  # a routing table (imgest eval --compare --out): query classes choose aliases
        routed = (route["a"], route["b"]) if route else ()
        self.aliases, self.device = tuple(dict.fromkeys((*aliases, *routed))), device
        self._served: dict[str, _Served] = {}
        self._errors: dict[str, str] = {}
        self._lock = threading.Lock()  # one refresh at a time; queries never take it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.swaps = 0

    def refresh(self) -> list[str]:
        """Load what each alias names now when it changed; returns the aliases swapped."""
        swapped = []
        with self._lock:
            for alias in self.aliases:
                try:
                    entry = read_alias(self.store, alias)
                    if entry is None:
                        raise SearchError(f"no alias {alias!r} in {self.store.url}")
                    current = self._served.get(alias)
                    if current is not None and (current.slug, current.version) == (entry["slug"], entry["version"]):
                        continue
                    searcher = self._loaded(entry["slug"], entry["version"]) or Searcher(self.store.url, alias,
                                                                                           device=self.device)
                    searcher.warm()  # weights and metadata map: the first query after a swap does not wait
                    card = searcher.card
                    # the new one is whole and verified: one assignment makes it the one queries take
                    self._served[alias] = _Served(searcher, card["slug"], int(card["version"]),
                                                  datetime.now(UTC).isoformat(timespec="seconds"))
                    self._errors.pop(alias, None)
                    self.swaps += current is not None
                    swapped.append(alias)
                except Exception as exc:  # noqa: BLE001 - the old version keeps serving; the failure is reported
                    self._errors[alias] = one_line(exc)
                    logging.getLogger("imgest").warning("alias %s: keeps serving %s: %s", alias,
                                                        self._describe(alias), self._errors[alias])
        return swapped

    def _loaded(self, slug: str, version: int) -> Searcher | None:
        """A version another alias already serves (two aliases on one version share its memory)."""
        return next((served.searcher for served in self._served.values()
                     if (served.slug, served.version) == (slug, version)), None)

    def _describe(self, alias: str) -> str:
        served = self._served.get(alias)
        return f"model={served.slug} v{served.version}" if served else "nothing (not loaded yet)"

    def ready(self) -> bool:
        """Every alias has a loaded version."""
        return all(alias in self._served for alias in self.aliases)

    def status(self) -> dict[str, dict]:
        """Per alias: the model and version served, its card's served recall, what encodes its queries, when it was
        loaded, and the last failure to load what the alias names (None when it serves what the alias names)."""
        out = {}
        for alias in self.aliases:
            served = self._served.get(alias)
            recall = None
            if served is not None:
                rec = served.searcher.card.get("recall") or {}
                recall = rec.get(f"recall@{rec.get('k')}")
            out[alias] = {"model": served.slug if served else None, "version": served.version if served else None,
                          "recall": recall, "query_encoded_by": served.searcher.query_encoded_by if served else None,
                          "loaded_at": served.loaded_at if served else None,
                          "error": self._errors.get(alias)}
        return out

    def search(self, queries: list[Query], k: int = 10, alias: str | list[str] | None = None,
               fuse: str | None = None, query_class: str | None = None, rrf_k: int = RRF_K,
               with_metadata: bool = False, where: str | None = None, group_by: str | None = None,
               per_group: int = 1) -> Answer:
        """Answer as `imgest search` would with the same options, on the versions the aliases serve at this
        moment, start to end (a swap during the query does not change them). Several aliases need `fuse="rrf"`
        (one alias with it fuses serving and shadow, as the command does); `query_class` lets the routing table
        choose. `with_metadata` adds each hit's catalogue metadata row."""
        names = [alias] if isinstance(alias, str) else list(dict.fromkeys(alias or []))
        how = None
        if query_class is not None:
            if self.route is None:
                raise SearchError("query_class needs a routing table: start the service with --route")
            if names or fuse:
                raise SearchError("query_class lets the routing table choose the aliases: give no alias or fuse")
            route = choose(self.route, query_class)
            names, combine, how = list(route.aliases), route.combine, route.how
        else:
            route = text_to_captions(fusion(names or [self.aliases[0]], fuse, rrf_k), queries, self._modalities)
            names, combine, how = list(route.aliases), route.combine, route.how
        taken = {name: self._take(name) for name in names}  # one read each: the request keeps these versions
        hits = answer([(name, served.searcher) for name, served in taken.items()], queries, k, combine, where,
                      group_by, per_group)
        metadata = None
        if with_metadata:
            metadata = taken[names[0]].searcher.metadata_of([h.item_id for row in hits for h in row])
        return Answer(hits, {name: (s.slug, s.version) for name, s in taken.items()}, how, metadata,
                      {name: s.searcher.query_encoded_by for name, s in taken.items()})

    def search_vectors(self, vectors: np.ndarray, k: int = 10, alias: str | None = None, **options) -> Answer:
        served = self._take(alias)
        return Answer(served.searcher.search_vectors(vectors, k, **options),
                      {alias or self.aliases[0]: (served.slug, served.version)})

    def locate(self, item_id: str, alias: str | None = None) -> tuple[str, str] | None:
        """(model slug, catalogue uri) of an item in the index an alias serves (the given one first, then the
        others); None when no served index holds it."""
        for name in dict.fromkeys([alias or self.aliases[0], *self.aliases]):
            served = self._served.get(name)
            uri = served.searcher.uri_of(item_id) if served is not None else None
            if uri is not None:
                return served.slug, uri
        return None

    def columns(self) -> list[dict]:
        """The metadata columns a request can filter or group by."""
        return self._take(None).searcher.metadata_columns()

    def _modalities(self, alias: str) -> tuple[str, ...] | None:
        served = self._served.get(alias) if alias in self.aliases else None
        return tuple(served.searcher.spec.modalities) if served is not None else None

    def _take(self, alias: str | None) -> _Served:
        name = alias or self.aliases[0]
        if name not in self.aliases:
            raise SearchError(f"alias {name!r} is not served here; served: {', '.join(self.aliases)}")
        served = self._served.get(name)  # one read of the reference: the query keeps this version
        if served is None:
            raise SearchError(f"alias {name!r} is not loaded yet: {self._errors.get(name, 'loading')}")
        return served

    def follow(self, every: float = 5.0) -> None:
        """Refresh every `every` seconds from a daemon thread until close()."""
        def loop() -> None:
            while not self._stop.wait(every):
                self.refresh()

        self._thread = threading.Thread(target=loop, name="imgest-follow-aliases", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
