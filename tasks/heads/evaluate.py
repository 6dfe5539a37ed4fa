"""A head scored on a given labelled query set (`train-head --eval-queries`, in `imgest eval`'s format): the
query images are encoded once by the base model (on the runtime and precision that encoded the catalogue); each
epoch projects them and the gallery through the head and counts hits (recall@K: a relevant item among the K
nearest, the query's `exclude` items left out), exactly, so epoch selection does not depend on an index. The
gallery is the training set's catalogue items, the live items the queries name, and a sample of other live items
drawn by shard (`--negatives`): the whole live set only when it is that small. The report gives base vs head with
the paired bootstrap interval of head - base."""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from imgest.images import decoders
from imgest.images.decode import decode_as
from imgest.retrieval.metrics import paired_bootstrap
from imgest.tasks.heads.train import HeadError, as_strings

KS = (1, 5, 10)
SIMILARITY_BLOCK = 1 << 25  # similarities (float32) of one block of queries against the gallery: 128 MB at most


@dataclass
class Gallery:
    """What the eval queries are searched among: item ids (Arrow) and their vectors, in parts (the training set's
    own array is searched in place, not copied), and how many live items there are in all."""

    item_ids: pa.Array
    parts: list[np.ndarray]
    live: int = 0
    negatives: int = 0

    @property
    def vectors(self) -> np.ndarray:
        return self.parts[0] if len(self.parts) == 1 else np.vstack(self.parts)


class QueryScorer:
    def __init__(self, url: str, sha256: str, query_ids: list[str], queries: np.ndarray, relevant: list[np.ndarray],
                 exclude: list[np.ndarray], gallery, dropped: int, searched: dict | None = None):
        self.url, self.sha256, self.query_ids, self.queries = url, sha256, query_ids, queries
        self.relevant, self.exclude, self.dropped = relevant, exclude, dropped
        self.parts = list(gallery.parts) if isinstance(gallery, Gallery) else [np.asarray(gallery, np.float32)]
        self.searched = searched or {}

    @property
    def gallery(self) -> np.ndarray:
        return self.parts[0] if len(self.parts) == 1 else np.vstack(self.parts)

    def hits(self, project=None) -> dict[int, np.ndarray]:
        """Per query and K in KS: 1.0 when a relevant live item is among the K nearest."""
        q = self.queries if project is None else project(self.queries)
        parts = self.parts if project is None else [project(p) for p in self.parts]
        size = sum(len(p) for p in parts)
        out = {k: np.zeros(len(q)) for k in KS}
        top = min(max(KS), size)
        step = int(np.clip(SIMILARITY_BLOCK // max(size, 1), 1, 256))
        for begin in range(0, len(q), step):
            block = q[begin:begin + step]
            sims = np.hstack([block @ p.T for p in parts]) if len(parts) > 1 else block @ parts[0].T
            for n in range(len(sims)):
                sims[n, self.exclude[begin + n]] = -np.inf
            order = np.argpartition(-sims, top - 1, axis=1)[:, :top]
            order = np.take_along_axis(order, np.argsort(-np.take_along_axis(sims, order, 1), axis=1), 1)
            for n, ranked in enumerate(order):
                found = np.isin(ranked, self.relevant[begin + n])
                for k in KS:
                    out[k][begin + n] = float(found[:k].any())
        return out

    def score(self, project) -> dict[str, float]:
        return {f"recall@{k}": float(v.mean()) for k, v in self.hits(project).items()}

    def report(self, project, resamples: int = 1000, seed: int = 0) -> dict:
        base, head = self.hits(None), self.hits(project)
        return {"file": self.url, "sha256": self.sha256, "queries": len(self.query_ids),
                "dropped_queries": self.dropped, **({"searched": self.searched} if self.searched else {}),
                "base": {f"recall@{k}": round(float(base[k].mean()), 5) for k in KS},
                "head": {f"recall@{k}": round(float(head[k].mean()), 5) for k in KS},
                "bootstrap": {f"recall@{k}": {key: value for key, value in
                                              paired_bootstrap(base[k], head[k], resamples, seed).items()
                                              if key != "samples"} for k in KS}}


def query_gallery(store, base: dict, url: str, item_ids, vectors: np.ndarray, negatives: int,
                  seed: int) -> Gallery:
    """The gallery of `url`'s queries: the training set's catalogue items (`item_ids`, `vectors`), the live items
    the queries name as relevant or excluded that are not among them, and `negatives` other live items drawn by
    shard (`shard_sample`), each read from the shards that hold it; never the whole live set."""
    from imgest.retrieval.querysets import read_query_set
    from imgest.state.committed import LIVE, load_state
    from imgest.state.live import live_rows_of, read_rows_vectors, shard_sample

    item_ids = as_strings(item_ids)
    named = pa.array(sorted({i for q in read_query_set(url) for i in (*q.relevant, *q.exclude)}), pa.string())
    named = named.filter(pc.invert(pc.is_in(named, value_set=item_ids)))
    state = load_state(store, base["slug"])
    try:
        extra = live_rows_of(state, pa.table({"item_id": named}))
        drawn = shard_sample(state, negatives, seed, pa.concat_arrays([item_ids, extra["item_id"].combine_chunks()]))
        live = state.count(LIVE)
    finally:
        state.close()
    rows, more = read_rows_vectors(store, base["slug"], int(base["dim"]), pa.concat_tables([extra, drawn]))
    return Gallery(pa.concat_arrays([item_ids, rows["item_id"].combine_chunks()]), [vectors, more], live,
                   len(rows) - len(extra))


def query_scorer(url: str, gallery, base_name: str, device: str = "auto", log=lambda line: None,
                 store=None, encoded_by: dict[str, int] | Counter | None = None) -> QueryScorer:
    """Read the query set, encode its images with the base model (decoded as the catalogue's images were in `store`:
    imgest/images/decoders.py `recorded`; Pillow without a store; on the runtime and precision that encoded most of
    the rows counted in `encoded_by`, as views are), map relevant and excluded ids to gallery rows (`gallery`: a
    Gallery, or anything with `item_ids` and `vectors`, such as the live vectors). A query none of whose relevant
    items is in the gallery cannot be scored and is dropped (counted)."""
    from imgest import encoders
    from imgest.retrieval.querysets import read_query_set
    from imgest.storage import read_url
    from imgest.tasks.heads.views import catalogue_encoder, recorded_encoding

    data = read_url(url)
    queries = read_query_set(url)
    if any(q.image is None for q in queries):
        raise HeadError(f"{url}: every query needs an image (a head is trained on image embeddings)")
    ids = as_strings(gallery.item_ids)
    relevant, exclude = _rows_of(ids, [q.relevant for q in queries]), _rows_of(ids, [q.exclude for q in queries])
    kept = [n for n, rows in enumerate(relevant) if len(rows)]
    if not kept:
        raise HeadError(f"{url}: no query has a relevant item among the {len(ids)} live items searched of {base_name}")
    spec = encoders.resolve(base_name)
    encoder = catalogue_encoder(spec, device, recorded_encoding(encoded_by), log)
    decode = decoders.recorded(store, spec.slug, encoder) if store is not None else \
        decoders.Decode(decoders.PILLOW, decoders.legacy_side(encoder) or None)
    chunks = []
    for begin in range(0, len(kept), 64):
        pixels = [encoder.preprocess(decode_as(read_url(queries[n].image), decode))
                  for n in kept[begin:begin + 64]]
        chunks.append(encoder.encode_images(np.stack(pixels)))
    searched = {}
    if isinstance(gallery, Gallery):
        searched = {"items": len(ids), "negatives": gallery.negatives, "live_items": gallery.live}
    log(f"{len(kept)} eval queries encoded by {base_name} on {encoder.runtime} {encoder.precision} "
        f"({len(queries) - len(kept)} without a relevant item among the {len(ids)} searched)")
    parts = gallery if isinstance(gallery, Gallery) else np.ascontiguousarray(gallery.vectors, np.float32)
    return QueryScorer(url, hashlib.sha256(data).hexdigest(), [queries[n].query_id for n in kept],
                       np.vstack(chunks).astype(np.float32), [relevant[n] for n in kept], [exclude[n] for n in kept],
                       parts, len(queries) - len(kept), searched)


def _rows_of(ids: pa.Array, lists: list[list[str]]) -> list[np.ndarray]:
    """Each list's ids as rows of `ids` (those not there left out): one lookup for all of them."""
    flat = pa.array([i for names in lists for i in names], pa.string())
    rows = pc.index_in(flat, value_set=ids).to_numpy(zero_copy_only=False)
    bounds = np.cumsum([0, *(len(names) for names in lists)])
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        found = rows[a:b]
        out.append(found[~np.isnan(found)].astype(np.int64) if found.dtype.kind == "f" else found.astype(np.int64))
    return out


@task(name="encode-eval-queries", cache_policy=NO_CACHE)
def scorer_task(store, base: dict, url: str, training, negatives: int, seed: int, device: str) -> QueryScorer:
    """The query set's scorer: its gallery read (`query_gallery`), its images encoded."""
    ids, vectors = training.originals()
    gallery = query_gallery(store, base, url, ids, vectors, negatives, seed)
    return query_scorer(url, gallery, base["name"], device, get_run_logger().info, store, training.encoded_by)
