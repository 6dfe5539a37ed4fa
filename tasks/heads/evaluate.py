"""A head scored on a given labelled query set (`train-head --eval-queries`, in `imgest eval`'s format): the
query images are encoded once by the base model; each epoch projects them and the live catalogue through the
head and counts hits (recall@K: a relevant item among the K nearest, the query's `exclude` items left out),
exactly, so epoch selection does not depend on an index. The report gives base vs head with the paired
bootstrap interval of head - base."""

from __future__ import annotations

import hashlib

import numpy as np

from imgest.images import decoders
from imgest.retrieval.metrics import paired_bootstrap
from imgest.tasks.heads.train import HeadError

KS = (1, 5, 10)


class QueryScorer:
    def __init__(self, url: str, sha256: str, query_ids: list[str], queries: np.ndarray, relevant: list[np.ndarray],
                 exclude: list[np.ndarray], gallery: np.ndarray, dropped: int):
        self.url, self.sha256, self.query_ids, self.queries = url, sha256, query_ids, queries
        self.relevant, self.exclude, self.gallery, self.dropped = relevant, exclude, gallery, dropped

    def hits(self, project=None) -> dict[int, np.ndarray]:
        """Per query and K in KS: 1.0 when a relevant live item is among the K nearest."""
        q = self.queries if project is None else project(self.queries)
        g = self.gallery if project is None else project(self.gallery)
        out = {k: np.zeros(len(q)) for k in KS}
        top = min(max(KS), len(g))
        for begin in range(0, len(q), 256):
            sims = q[begin:begin + 256] @ g.T
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
                "dropped_queries": self.dropped,
                "base": {f"recall@{k}": round(float(base[k].mean()), 5) for k in KS},
                "head": {f"recall@{k}": round(float(head[k].mean()), 5) for k in KS},
                "bootstrap": {f"recall@{k}": {key: value for key, value in
                                              paired_bootstrap(base[k], head[k], resamples, seed).items()
                                              if key != "samples"} for k in KS}}


def query_scorer(url: str, live, base_name: str, device: str = "auto", log=lambda line: None,
                 decoder: str = decoders.PILLOW) -> QueryScorer:
    """Read the query set, encode its images with the base model (decoded by `decoder`, the one the catalogue's
    images were: imgest/images/decoders.py `recorded`), map relevant and excluded ids to live rows.
    A query none of whose relevant items is live cannot be scored and is dropped (counted)."""
    from imgest import encoders
    from imgest.images.decode import decode_image
    from imgest.retrieval.querysets import read_query_set
    from imgest.storage import read_url

    data = read_url(url)
    queries = read_query_set(url)
    if any(q.image is None for q in queries):
        raise HeadError(f"{url}: every query needs an image (a head is trained on image embeddings)")
    row_of = {item_id: row for row, item_id in enumerate(live.item_ids)}
    kept, relevant, exclude = [], [], []
    for q in queries:
        rows = np.array([row_of[i] for i in q.relevant if i in row_of], dtype=np.int64)
        if len(rows):
            kept.append(q)
            relevant.append(rows)
            exclude.append(np.array([row_of[i] for i in q.exclude if i in row_of], dtype=np.int64))
    if not kept:
        raise HeadError(f"{url}: no query has a relevant item among the {len(live)} live items of {base_name}")
    encoder = encoders.load(encoders.resolve(base_name), device)
    side = getattr(encoder, "decode_side", None)
    chunks = []
    for begin in range(0, len(kept), 64):
        pixels = [encoder.preprocess(decode_image(read_url(q.image), min_side=side, decoder=decoder))
                  for q in kept[begin:begin + 64]]
        chunks.append(encoder.encode_images(np.stack(pixels)))
    log(f"{len(kept)} eval queries encoded by {base_name} ({len(queries) - len(kept)} without a live relevant item)")
    return QueryScorer(url, hashlib.sha256(data).hexdigest(), [q.query_id for q in kept],
                       np.vstack(chunks).astype(np.float32), relevant, exclude,
                       np.ascontiguousarray(live.vectors, np.float32), len(queries) - len(kept))
