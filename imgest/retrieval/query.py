"""Search an index by image or text, with exactly the model that built it, run as its catalogue's vectors were."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from imgest import encoders
from imgest.encoders import EncoderError
from imgest.errors import UserError
from imgest.images import decoders
from imgest.images.decode import decode_as
from imgest.names import PRECISIONS, RUNTIMES
from imgest.retrieval.filters import FilterError, filtered_search, grouped, matching_items
from imgest.retrieval.item_metadata import FAISS_ID, INTERNAL, VersionMetadata
from imgest.retrieval.versions import DEFAULT_CACHE, OpenIndex, open_index, resolve_target
from imgest.state.models import find_model
from imgest.storage import open_location, read_url


class SearchError(UserError, ValueError):
    """A query cannot be answered correctly (wrong model, no text tower, bad query); never a wrong answer."""


class UnknownItem(SearchError):
    """A query by item id names no live item of the model asked (HTTP 404)."""


@dataclass
class Hit:
    rank: int
    item_id: str
    uri: str
    score: float
    group: str | None = None  # with --group-by: the group (e.g. product_id) this hit stands for
    found_by: list[tuple[str, int]] | None = None  # fused: (alias, rank there) of each retriever that found it


@dataclass
class Query:
    query_id: str
    image: str | None = None
    text: str | None = None
    image_bytes: bytes | None = None  # an image given as bytes (an upload): never a URL to fetch
    item_id: str | None = None  # "more like this": the item's stored embedding in each model asked


def _image_bytes(query: Query) -> bytes:
    return query.image_bytes if query.image_bytes is not None else read_url(query.image)


def read_queries(url: str) -> list[Query]:
    """JSONL: one object per line with ``query_id`` and ``image`` (path or URL), ``text`` or ``item_id``."""
    queries = []
    for number, line in enumerate(read_url(url).decode().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SearchError(f"{url} line {number}: not JSON ({exc})") from exc
        if not isinstance(obj, dict) or "query_id" not in obj or not {"image", "text", "item_id"} & set(obj):
            raise SearchError(f"{url} line {number}: needs query_id and an image, a text (or both) or an item_id; "
                              f"got {sorted(obj) if isinstance(obj, dict) else type(obj).__name__}")
        item = obj.get("item_id")
        queries.append(Query(str(obj["query_id"]), obj.get("image"), obj.get("text"),
                             item_id=None if item is None else str(item)))
    return queries


class Searcher:
    """An opened index plus its encoder; load once, answer many queries."""

    def __init__(self, store_url: str, alias: str | None = "serving", model: str | None = None,
                 version: int | None = None, device: str = "auto"):
        self.store = open_location(store_url, must_exist=True, what="store")
        slug = find_model(self.store, model)["slug"] if model else None
        slug, version = resolve_target(self.store, None if slug else alias, slug, version)
        self.opened: OpenIndex = open_index(self.store, slug, version)
        card = self.opened.card
        spec = encoders.resolve_recorded(card.get("model_name"), self.store, f"{self.store.url}: index card of "
                                         f"model={slug} v{version}")
        if spec.model_id != card["model_id"]:
            raise SearchError(f"index v{version} of model={slug} was built by {card['model_id']}, but "
                              f"{card['model_name']} here is {spec.model_id}: queries would be embedded by a "
                              "different model; rebuild the index or restore those weights")
        self.spec, self.device = spec, device
        self._encoder = None
        self._decode: decoders.Decode | None = None
        self._metadata_file: VersionMetadata | bool | None = None  # the items' metadata by faiss id, mapped
        self._filters: dict[str, np.ndarray] = {}  # --where predicate -> faiss ids
        self._group_maps: dict[str, GroupsAt] = {}  # --group-by column -> item_id -> value
        self._stored = None  # StoredVectors, made on the first query by item id

    @property
    def card(self) -> dict:
        return self.opened.card

    def warm(self) -> None:
        """Load now what the first query would otherwise wait for: the model's weights and the version's
        metadata file, made if this host has none yet (a long-lived reader calls it before serving a version)."""
        self.decode()
        self.metadata_of([])

    def encoder(self):
        if self._encoder is None:
            self._encoder = query_encoder(self.spec, self.device, self.card)
        return self._encoder

    def decode(self) -> decoders.Decode:
        """How the catalogue's images were decoded for this model (its recorded decoder and decode side,
        imgest/images/decoders.py), read once: query images decode alike."""
        if self._decode is None:
            self._decode = decoders.recorded(self.store, self.card["slug"], self.encoder())
        return self._decode

    @property
    def query_encoded_by(self) -> str | None:
        """What encodes this searcher's queries ("openvino fp32"), once loaded."""
        return None if self._encoder is None else f"{self._encoder.runtime} {self._encoder.precision}"

    def modality(self, query: Query) -> str:
        """What of a query this model embeds: its text when the query has text and the model a text tower
        (a caption model; CLIP's cross-modal search), else its image. A query may carry both (a photo and
        words): each retriever then takes what it can read, so two retrievers answer the same query."""
        modalities = self.spec.modalities
        if query.item_id is not None:
            return "item"
        if query.text is not None and "text" in modalities:
            return "text"
        if (query.image is not None or query.image_bytes is not None) and "image" in modalities:
            return "image"
        if query.text is not None:
            raise SearchError(f"{self.spec.name} has no text tower: text queries are refused (image queries work)")
        raise SearchError(f"{self.spec.name} is a text model over catalogue captions: search it with --text "
                          "(image queries go to an image model's alias)")

    def embed(self, queries: list[Query]) -> np.ndarray:
        kinds = [self.modality(q) for q in queries]
        encoder = self.encoder()
        vectors = np.zeros((len(queries), self.spec.dim), np.float32)
        image_rows = [i for i, kind in enumerate(kinds) if kind == "image"]
        if image_rows:
            decode = self.decode()  # the JPEG decode the catalogue got: its decoder, down to its side
            pixels = [encoder.preprocess(decode_as(_image_bytes(queries[i]), decode)) for i in image_rows]
            vectors[image_rows] = encoder.encode_images(np.stack(pixels))
        text_rows = [i for i, kind in enumerate(kinds) if kind == "text"]
        if text_rows:
            try:
                vectors[text_rows] = encoder.encode_texts([queries[i].text for i in text_rows])
            except EncoderError as exc:
                raise SearchError(str(exc)) from exc
        for row in (i for i, kind in enumerate(kinds) if kind == "item"):
            vectors[row] = self.stored_vector(queries[row].item_id)
        return vectors

    def stored_vector(self, item_id: str) -> np.ndarray:
        """An item's own embedding in this model: the float vector this index holds for it when it stores vectors
        uncompressed (Flat, HNSW,Flat: no I/O), else the one its shard holds (UnknownItem when it is not live)."""
        from imgest.retrieval.items import ItemNotFound, StoredVectors, stores_vectors

        if stores_vectors(self.card) and (position := self.position(item_id)) is not None:
            return self.opened.index.reconstruct(position)
        if self._stored is None:
            self._stored = StoredVectors(self.store, self.card["slug"], self.spec.dim, ids=self.opened.ids)
        try:
            return self._stored.vector(item_id)
        except ItemNotFound as exc:
            raise UnknownItem(str(exc)) from exc

    def search_vectors(self, vectors: np.ndarray, k: int = 10, where: str | None = None,
                       group_by: str | None = None, per_group: int = 1,
                       exclude: list[str | None] | None = None) -> list[list[Hit]]:
        """Top k per query; with `where`, only items whose metadata satisfies it (never fewer than k when k
        do); with `group_by`, at most `per_group` hits per value of that metadata column; `exclude` leaves one
        item out of each query's hits (a query by item id does not find itself)."""
        if vectors.ndim != 2 or vectors.shape[1] != self.spec.dim:
            raise SearchError(f"query vectors have shape {vectors.shape}; this index takes (n, {self.spec.dim})")
        if k < 1 or per_group < 1:
            raise SearchError(f"k and per_group must be >= 1; got k={k}, per_group={per_group}")
        allowed = self._allowed(where) if where else None
        skip = exclude or [None] * len(vectors)
        if group_by is None:
            hits = self._hits(*self._search(vectors, k + any(skip), allowed))
            return [_ranked([h for h in row if h.item_id != item][:k]) for row, item in zip(hits, skip)]
        group_of = self.groups(group_by)
        limit = self.opened.index.ntotal if allowed is None else len(allowed)
        depth, results = min(limit, 4 * k * per_group + any(skip)), [None] * len(vectors)
        todo = list(range(len(vectors)))
        while todo:
            hits = self._hits(*self._search(vectors[todo], depth, allowed))
            hits = [[h for h in row if h.item_id != skip[q]] for q, row in zip(todo, hits)]
            left = []
            for row, row_hits in zip(todo, hits):
                results[row], full = grouped(row_hits, group_of, k, per_group)
                if not full and depth < limit:
                    left.append(row)
            todo, depth = left, min(limit, depth * 4)
        return results

    def search(self, queries: list[Query], k: int = 10, where: str | None = None, group_by: str | None = None,
               per_group: int = 1) -> list[list[Hit]]:
        return self.search_vectors(self.embed(queries), k, where, group_by, per_group,
                                   [q.item_id for q in queries])

    def _hits(self, scores: np.ndarray, ids: np.ndarray) -> list[list[Hit]]:
        """Hits of faiss ids `ids`, their items and uris looked up in the id map (only the rows found)."""
        found = ids[ids >= 0]
        items = iter(self.opened.ids.items(found))
        uris = iter(self.opened.ids.uris_of(found))
        return [[Hit(rank + 1, next(items), next(uris), float(s)) for rank, (s, i) in enumerate(zip(srow, irow))
                 if i >= 0] for srow, irow in zip(scores, ids)]

    def _search(self, vectors: np.ndarray, k: int, allowed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        if allowed is None:
            return self.opened.search(vectors, k)
        search = self.card["search"]
        return filtered_search(self.opened.index, vectors, k, allowed, search["param"], search["value"],
                               search.get("k_factor"))

    def _metadata(self) -> VersionMetadata:
        """The version's items' metadata (imgest/retrieval/item_metadata.py), opened once: the snapshot it was
        made from stays this searcher's, as its index does."""
        if self._metadata_file is None:
            try:
                self._metadata_file = VersionMetadata(self.store, self.opened.ids, DEFAULT_CACHE)
            except LookupError:
                self._metadata_file = False  # read once: a store without metadata is not asked again per query
        if self._metadata_file is False:
            raise SearchError("this store holds no catalogue metadata to filter or group by: ingest with "
                              "--metadata FILE_OR_URL first")
        return self._metadata_file

    def _allowed(self, where: str) -> np.ndarray:
        """The faiss ids of indexed items whose metadata satisfies `where`; kept per predicate for the
        Searcher's life (its index and metadata snapshot do not change under it). DuckDB reads the columns the
        predicate names from the mapped file, and item_id from the version's id map."""
        if where in self._filters:
            return self._filters[where]
        metadata = self._metadata()
        table = metadata.table.add_column(0, "item_id", self._ids())
        for name in [FAISS_ID, *(n for n in table.column_names if re.search(rf"\b{re.escape(n)}\b", where))]:
            # the columns the predicate may name, read ahead of DuckDB's scan (a name inside a quoted value too)
            (self.opened.ids.file if name == "item_id" else metadata.file).will_scan(table.column(name))
        try:
            found = matching_items(table, where, select=FAISS_ID, hidden=tuple(INTERNAL))
        except FilterError as exc:
            raise SearchError(str(exc)) from exc
        self._filters[where] = metadata.with_rows(found.to_numpy(zero_copy_only=False).astype(np.int64))
        return self._filters[where]

    def _ids(self) -> pa.ChunkedArray:
        return self.opened.ids.item_ids

    def position(self, item_id: str) -> int | None:
        """An item's faiss id in this index; None when the item is not in it."""
        return self.opened.ids.position(item_id)

    def uri_of(self, item_id: str) -> str | None:
        """The catalogue uri this index recorded for an item; None when the item is not in it."""
        position = self.position(item_id)
        return None if position is None else self.opened.ids.uri(position)

    def metadata_columns(self) -> list[dict]:
        """The catalogue metadata columns a search can filter or group by ([] when the store holds none), as
        worked out when the version's metadata file was made."""
        try:
            return self._metadata().columns
        except SearchError:
            return []

    def metadata_of(self, item_ids: list[str]) -> dict[str, dict]:
        """Each indexed item's catalogue metadata row (item_id and row_hash left out); {} when the store holds
        none. A lookup per hit: its faiss id's rows of the mapped file."""
        try:
            metadata = self._metadata()
        except SearchError:
            return {}
        wanted = list(dict.fromkeys(item_ids))
        at = self.opened.ids.positions(wanted)
        held = at >= 0
        rows = metadata.rows(at[held])
        return {item: row for item, row in zip((i for i, h in zip(wanted, held) if h), rows) if row is not None}

    def groups(self, column: str) -> GroupsAt:
        """item_id -> its value of `column` (GroupsAt.get), kept per column like the filters."""
        if column not in self._group_maps:
            metadata = self._metadata()
            if column not in metadata.names:
                raise SearchError(f"--group-by {column!r}: no such metadata column; columns: "
                                  f"{', '.join(metadata.names)}")
            self._group_maps[column] = GroupsAt(metadata, self.opened.ids, column)
        return self._group_maps[column]


class GroupsAt:
    """item_id -> its value of one metadata column (str, None when it has none): the item's faiss id by the id
    map's binary search, then one row of the column's mapped pages. No map of every item."""

    def __init__(self, metadata: VersionMetadata, ids, column: str) -> None:
        self.metadata, self.ids, self.name = metadata, ids, column

    def get(self, item_id: str, default: str | None = None) -> str | None:
        at = self.ids.position(item_id)
        value = None if at is None else self.metadata.value(self.name, at)
        return default if value is None else str(value)


def catalogue_encoding(card: dict) -> tuple[str, str] | None:
    """The runtime and precision that made most of a version's vectors (its card's `encoded_by`, rows per
    "runtime precision"), or None when the card does not say (a version built before it was recorded, shards
    that did not record it, an encoder that runs as it is). The card is read from the store: a pair names only a
    known runtime and precision, never anything to load."""
    mix = card.get("encoded_by")
    counts: dict[tuple[str, str], int] = {}
    for key, rows in (mix.items() if isinstance(mix, dict) else ()):
        pair = tuple(str(key).split(" "))
        if len(pair) == 2 and pair[0] in RUNTIMES and pair[1] in PRECISIONS and "auto" not in pair \
                and isinstance(rows, int) and not isinstance(rows, bool) and rows > 0:
            counts[pair] = counts.get(pair, 0) + rows
    return max(counts, key=counts.get) if counts else None


def query_encoder(spec, device: str, card: dict):
    """The encoder for a version's queries: the runtime and precision its catalogue was encoded with, behind the
    same parity check as ingest (so a query vector is made the way the catalogue's were), else, when that cannot
    run here (another device, a runtime not installed, a parity refusal), the plain encoder with one warning."""
    made = catalogue_encoding(card)
    encoders.refuse_missing_packages(spec)  # no runtime runs it without them: one refusal, never a fallback's warning
    if made is not None:
        try:
            return encoders.load(spec, device, *made)
        except EncoderError as exc:
            logging.getLogger("imgest").warning(
                "queries of model=%s v%s: the catalogue was encoded with %s, which cannot run here (%s): encoding "
                "queries with the plain encoder", card.get("slug"), card.get("version"), " ".join(made), exc)
    return encoders.load(spec, device)


def search(store_url: str, *, image: str | None = None, text: str | None = None, item_id: str | None = None,
           k: int = 10, alias: str | None = "serving", model: str | None = None, version: int | None = None,
           device: str = "auto", where: str | None = None, group_by: str | None = None,
           per_group: int = 1) -> list[Hit]:
    """One query by image (path or URL), by text or by item id; the Python mirror of ``imgest search``."""
    if sum(x is not None for x in (image, text, item_id)) != 1:
        raise SearchError("give exactly one of image, text or item_id")
    searcher = Searcher(store_url, alias, model, version, device)
    return searcher.search([Query("q", image, text, item_id=item_id)], k, where, group_by, per_group)[0]


def _ranked(hits: list[Hit]) -> list[Hit]:
    for rank, hit in enumerate(hits, 1):
        hit.rank = rank
    return hits
