"""Candidate models against the alias's model on one sample of its catalogue: recall, paired interval, encode cost.

Candidates are not in the store, and re-encoding the whole catalogue to compare them is the cost being decided.
So every model, the alias's own included, encodes the same sample (the query set's relevant items that are live,
plus a seeded draw of other live items) and the queries, through one code path, and is searched exactly over it.
Recall over a sample of n items is higher than over the catalogue's N: the figures are for comparing models.
The time each model took to decode, preprocess and encode the sample (the read not counted) is its cost per image
on this host, projected to the catalogue's size as `imgest report cost` projects.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from PIL import Image
from prefect import task
from prefect.cache_policies import NO_CACHE

from imgest import encoders
from imgest.encoders import Encoder, EncoderSpec
from imgest.images import decoders
from imgest.images.decode import DecodeError, decode_as
from imgest.progress import report
from imgest.retrieval.metrics import evaluate, paired_bootstrap, per_query
from imgest.retrieval.query import Searcher, catalogue_encoding
from imgest.retrieval.querysets import LabelledQuery, QuerySetError
from imgest.state.catalogue_images import CatalogueImages
from imgest.state.live import LiveShards, live_set, sample_rows
from imgest.state.rows import sql_string
from imgest.storage import StorageError, read_url
from imgest.storage.records import RecordError
from imgest.tasks.evaluate.retrievers import ExactScan, ranked
from imgest.timing import Stopwatch, projected_hours

ENCODE_BATCH = 32  # sample images decoded and encoded at a time
NOTE = ("every model encodes the same sample (the relevant items plus seeded distractors) and is searched exactly "
        "over it; recall over a sample is higher than over the whole catalogue, so compare the models, not these "
        "figures with a served index's; encode cost: decode + preprocess + encode of the sample in one process, on the "
        "runtime and precision the alias's catalogue was encoded with, each candidate behind its own parity check "
        "(ingest overlaps decode with encode on every core, so its hours are fewer; compare the models)")


@dataclass
class Sample:
    item_ids: list[str]  # item_id order
    uris: list[str]
    relevant: int  # of them, relevant to a query
    live: int  # live items of the model: the catalogue's size


def draw_sample(live: LiveShards, queries: list[LabelledQuery], limit: int, seed: int) -> Sample:
    """The queries' relevant items that are live, plus `limit` live items drawn with `seed` (`sample_rows` over
    the live set in item_id order). Rows are looked up in the live set on disk (DuckDB); only the sample is held."""
    relevant = sorted({item for q in queries for item in q.relevant})
    wanted = pa.table({"row": pa.array(sample_rows(len(live), limit, seed), pa.int64())})
    with live.connect() as con:
        con.register("wanted", wanted)
        drawn = con.sql(f"SELECT item_id FROM read_parquet({sql_string(live.by_shard)}) SEMI JOIN wanted USING (row)"
                        ).to_arrow_table()["item_id"].combine_chunks()
    rows = live.rows_of(pa.concat_arrays([pa.array(relevant, pa.string()), drawn.cast(pa.string())]))
    item_ids, uris = rows["item_id"].to_pylist(), rows["uri"].to_pylist()
    held = set(relevant).intersection(item_ids)
    if relevant and not held:
        raise QuerySetError(f"none of the {len(relevant)} relevant item ids (e.g. {relevant[0]!r}) is live in the "
                            "model: was the query set built from another catalogue root? Item ids are keys "
                            "relative to the ingested catalogue")
    return Sample(item_ids, uris, len(held), len(live))


def modality(spec: EncoderSpec, query: LabelledQuery) -> str:
    """What of a query a model embeds, as search decides it: its text when the model has a text tower, else its
    image."""
    if query.text is not None and "text" in spec.modalities:
        return "text"
    if query.image is not None and "image" in spec.modalities:
        return "image"
    raise QuerySetError(f"query {query.query_id}: {spec.name} reads neither what it has (an image model needs an "
                        "image, a caption model a text)")


def embed_queries(encoder: Encoder, queries: list[LabelledQuery], decode: decoders.Decode) -> np.ndarray:
    """Each query in the modality its model reads, decoded as the catalogue's images are for it (`decode`)."""
    vectors = np.zeros((len(queries), encoder.spec.dim), np.float32)
    kinds = [modality(encoder.spec, q) for q in queries]
    for kind in ("image", "text"):
        rows = [i for i, k in enumerate(kinds) if k == kind]
        for begin in range(0, len(rows), ENCODE_BATCH):
            chunk = rows[begin:begin + ENCODE_BATCH]
            if kind == "text":
                vectors[chunk] = encoder.encode_texts([queries[i].text for i in chunk])
            else:
                vectors[chunk] = encoder.encode_images(np.stack([encoder.preprocess(decode_as(
                    read_url(queries[i].image), decode)) for i in chunk]))
    return vectors


@dataclass
class Encoded:
    vectors: np.ndarray  # (n, d); a row whose image could not be read or decoded is zero
    ok: np.ndarray  # (n,) bool: the row was encoded
    seconds: float  # decode + preprocess + encode of the rows encoded


def encode_sample(encoder: Encoder, images: CatalogueImages, uris: list[str], decode: decoders.Decode) -> Encoded:
    """The sample's images through `encoder` a batch at a time, timed from the bytes read to the vectors (an
    image that cannot be read or decoded is that image's fault: skipped, logged)."""
    side = getattr(encoder, "decode_side", None)
    warm = encoder.preprocess(Image.new("RGB", (side or 256, side or 256), "grey"))
    encoder.encode_images(np.stack([warm]))  # the first call's allocations and kernels are not a per-image cost
    vectors = np.zeros((len(uris), encoder.spec.dim), np.float32)
    ok = np.zeros(len(uris), bool)
    work = Stopwatch(running=False)
    for begin in range(0, len(uris), ENCODE_BATCH):
        read = []
        for row in range(begin, min(begin + ENCODE_BATCH, len(uris))):
            try:
                read.append((row, images.read(uris[row])))
            except (StorageError, RecordError, OSError) as exc:
                logging.getLogger("imgest").warning("candidates: %s not read: %s", uris[row], exc)
        rows, pixels = [], []
        with work:
            for row, data in read:
                try:
                    pixels.append(encoder.preprocess(decode_as(data, decode)))
                    rows.append(row)
                except DecodeError as exc:
                    logging.getLogger("imgest").warning("candidates: %s not decoded: %s", uris[row], exc)
            if pixels:
                vectors[rows] = encoder.encode_images(np.stack(pixels))
        ok[rows] = True
        report(f"candidates: {encoder.spec.name}", min(begin + ENCODE_BATCH, len(uris)), len(uris))
    logging.getLogger("imgest").info("candidates: %s encoded %d of %d sampled images in %.1f s", encoder.spec.name,
                                     ok.sum(), len(uris), work.elapsed)
    return Encoded(vectors, ok, work.elapsed)


def load_as_catalogue(spec: EncoderSpec, device: str, made: tuple[str, str] | None) -> Encoder:
    """`spec` on the runtime and precision that made the alias's catalogue (`made`), behind that runtime's parity
    check, so that every row's cost is measured on one runtime; torch fp32, with one warning, where it cannot run."""
    if made is not None:
        try:
            return encoders.load(spec, device, *made)
        except encoders.EncoderError as exc:
            logging.getLogger("imgest").warning("candidates: %s cannot run on %s here (%s): timed on torch fp32",
                                                spec.name, " ".join(made), exc)
    return encoders.load(spec, device)


def _interval(boot: dict) -> dict:
    return {k: boot[k] for k in ("difference", "low", "high", "confidence", "resamples", "seed", "p_b_not_better")}


def compare_candidates(store_url: str, queries: list[LabelledQuery], alias: str, candidates: list[str],
                       ks: list[int], sample: int = 2000, seed: int = 0, resamples: int = 1000, device: str = "auto",
                       catalogue: str | None = None) -> dict:
    """The alias's model and each candidate on one sample of the alias's live items: recall@K by exact search,
    the paired bootstrap of (candidate - alias's model) per K over the queries, encode ms per image on this host
    and the hours to encode the catalogue's live items at that rate. Everything that can refuse (names, query
    modalities, the catalogue root) refuses before any image is encoded."""
    ks = sorted(set(ks))
    searcher = Searcher(store_url, alias=alias, device=device)
    store, card = searcher.store, searcher.card
    if "image" not in searcher.spec.modalities:
        raise QuerySetError(f"alias {alias!r} serves {searcher.spec.name}, a text model over captions: candidates "
                            "are image models, compared with an image model's alias")
    specs = [searcher.spec]
    for name in candidates:
        spec = encoders.resolve(name)
        if spec.model_id not in {s.model_id for s in specs}:  # a candidate that is the alias's model is its row
            specs.append(spec)
    for spec in specs:
        for q in queries:
            modality(spec, q)
    images = CatalogueImages(store, card["slug"], catalogue)
    picked = draw_sample(live_set(store, card["slug"]), queries, sample, seed)
    encoded, query_vectors, runs_on, on = [], [], [], "cpu"
    made = catalogue_encoding(card)
    for spec in specs:
        encoder = load_as_catalogue(spec, device, made)
        on = encoder.device
        runs_on.append(f"{encoder.runtime} {encoder.precision}")
        # each model decodes as its vectors are made: the serving one as its record says, a candidate as its first
        # run would
        decode = searcher.decode() if spec.slug == card["slug"] else decoders.default_decode(encoder)
        encoded.append(encode_sample(encoder, images, picked.uris, decode))
        query_vectors.append(embed_queries(encoder, queries, decode))
    ok = np.logical_and.reduce([e.ok for e in encoded])  # the same items for every model
    item_ids = pa.array([item for item, keep in zip(picked.item_ids, ok) if keep], pa.string())
    qrels = {q.query_id: set(q.relevant) for q in queries}
    depth = max(ks) + max((len(q.exclude) for q in queries), default=0)
    baseline, rows = {}, []
    for spec, done, vectors, runtime in zip(specs, encoded, query_vectors, runs_on):
        scan = ExactScan(vectors, depth)
        scan.add(done.vectors[ok], item_ids)
        run, _ = ranked(queries, scan.scores, scan.names, max(ks))
        hits = {k: per_query(run, qrels, f"recall@{k}") for k in ks}
        baseline = baseline or hits
        timed = int(done.ok.sum())
        per_image = done.seconds / timed if timed else None
        rows.append({"name": spec.name, "model_id": spec.model_id, "d": spec.dim,
                     "role": alias if spec is searcher.spec else "candidate",
                     "recall": evaluate(run, qrels, [f"recall@{k}" for k in ks]),
                     "vs_alias": None if spec is searcher.spec else {
                         f"recall@{k}": _interval(paired_bootstrap(
                             [baseline[k][q] for q in qrels], [hits[k][q] for q in qrels], resamples, seed))
                         for k in ks},
                     "images_timed": timed, "runtime": runtime,
                     "encode_ms_per_image": float(f"{per_image * 1000:.4g}") if per_image else None,
                     "projected_hours": projected_hours(picked.live, 1 / per_image) if per_image else None})
    relevant = set().union(*qrels.values())
    return {"alias": alias, "slug": card["slug"], "queries": len(queries), "ks": ks, "device": on,
            "catalogue_items": picked.live,
            "sample": {"items": int(ok.sum()), "relevant": sum(item in relevant for item in item_ids.to_pylist()),
                       "limit": sample, "seed": seed, "unreadable": int((~ok).sum())},
            "models": rows, "note": NOTE}


compare_candidates_task = task(compare_candidates, name="compare-candidates", cache_policy=NO_CACHE)

