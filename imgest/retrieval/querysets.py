"""Query sets for evaluation: read JSONL/Parquet, build blind class-level and instance-level sets.

A query is one JSON object (or Parquet row): ``query_id``, ``image`` (path/URL) or ``text``,
``relevant`` (item ids), optional ``class``, optional ``exclude`` (item ids never counted in its
ranking: the query's own catalogue item, as BEIR drops self-matches).
"""

from __future__ import annotations

import io
import json
import posixpath
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow.parquet as pq
from PIL import ImageEnhance, ImageOps

from imgest.errors import UserError
from imgest.images.decode import decode_image
from imgest.images.listing import list_catalogue
from imgest.state.clock import now_iso
from imgest.storage import Location, read_url


class QuerySetError(UserError, ValueError):
    """A query set line is malformed; the message names the line and the rule."""


@dataclass
class LabelledQuery:
    query_id: str
    relevant: list[str]
    image: str | None = None
    text: str | None = None
    cls: str | None = None
    exclude: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if v not in (None, []) and k != "cls"}
        if self.cls is not None:
            out["class"] = self.cls
        return out


def _from_obj(obj: dict, where: str) -> LabelledQuery:
    if "query_id" not in obj or (obj.get("image") is None and obj.get("text") is None):
        raise QuerySetError(f"{where}: needs query_id and an image or a text (both: each retriever takes what "
                            "its model reads)")
    relevant = obj.get("relevant")
    if not relevant:
        raise QuerySetError(f"{where}: needs a non-empty list 'relevant' of item ids")
    return LabelledQuery(str(obj["query_id"]), [str(r) for r in relevant], obj.get("image"), obj.get("text"),
                         obj.get("class"), [str(e) for e in obj.get("exclude") or []])


def read_query_set(url: str) -> list[LabelledQuery]:
    data = read_url(url)
    if url.endswith(".parquet"):
        return [_from_obj(row, f"{url} row {i}") for i, row in enumerate(pq.read_table(io.BytesIO(data)).to_pylist())]
    queries = []
    for number, line in enumerate(data.decode().splitlines(), 1):
        if line.strip():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise QuerySetError(f"{url} line {number}: not JSON ({exc})") from exc
            queries.append(_from_obj(obj, f"{url} line {number}"))
    if len({q.query_id for q in queries}) != len(queries):
        raise QuerySetError(f"{url}: query_id values must be unique")
    return queries


def write_query_set(url: str, queries: list[LabelledQuery], meta: dict) -> None:
    parent, name = posixpath.split(url.rstrip("/"))
    loc = Location(parent or ".")
    loc.write_bytes(name, "".join(json.dumps(q.to_json()) + "\n" for q in queries).encode())
    loc.write_json(f"{name}.meta.json", {**meta, "queries": len(queries), "created": now_iso()})


def build_class_queries(catalogue_url: str, out: str, per_class: int = 10, seed: int = 0, prefix: str = "") -> dict:
    """Class-level blind set: the label is the item's parent folder; ``per_class`` items per class are
    drawn (seeded) as queries; every other item of the class is relevant; the query item is excluded.

    ``catalogue_url`` must be the root the store was ingested from (item ids are keys below it);
    ``prefix`` keeps only the keys under it (e.g. ``fashion/``)."""
    import duckdb

    from imgest.state.rows import sql_string

    listing = list_catalogue(catalogue_url)
    catalogue = Location(listing.catalogue, follow_links=True)
    rng = np.random.default_rng(seed)
    queries, classes = [], []
    # the listing stays in its Parquet files: DuckDB counts each class, then hands back one class's keys at a time
    with duckdb.connect(config={"memory_limit": "256MB", "threads": 1}) as con:
        if listing.table is not None:
            con.register("listed", listing.table)
        else:
            con.read_parquet(listing.files).create_view("listed")
        con.execute(f"""CREATE VIEW items AS SELECT key, coalesce(nullif(
            regexp_extract(rtrim(regexp_extract(key, '^(.*)/[^/]*$', 1), '/'), '([^/]*)$', 1), ''), '_root') AS label
            FROM listed WHERE starts_with(key, {sql_string(prefix)})""")
        counts = dict(con.execute("SELECT label, count(*) FROM items GROUP BY label").fetchall())
        for label in sorted(counts):
            classes.append(label)
            if counts[label] < 2:
                continue
            picks = rng.choice(counts[label], size=min(per_class, counts[label] - 1), replace=False)
            items = con.sql("SELECT key FROM items WHERE label = $label ORDER BY key", params={"label": label}) \
                .to_arrow_table().column("key").to_pylist()
            for i in sorted(picks):
                item = items[i]
                queries.append(LabelledQuery(f"{label}/{posixpath.basename(item)}", [x for x in items if x != item],
                                             image=catalogue.uri(item), cls=label, exclude=[item]))
    meta = {"kind": "class", "catalogue": listing.catalogue, "prefix": prefix, "seed": seed, "per_class": per_class,
            "classes": classes, "label": "parent folder", "self_match": "excluded"}
    write_query_set(out, queries, meta)
    return meta | {"queries": len(queries)}


TRANSFORMS = {
    "crop": lambda im, rng: im.crop(_crop_box(im.size, rng)),
    "flip": lambda im, rng: ImageOps.mirror(im),
    "colour": lambda im, rng: ImageEnhance.Color(ImageEnhance.Brightness(im).enhance(rng.uniform(0.7, 1.3)))
    .enhance(rng.uniform(0.3, 1.7)),
}


def _crop_box(size: tuple[int, int], rng) -> tuple[int, int, int, int]:
    w, h = size
    scale = rng.uniform(0.6, 0.85)
    cw, ch = int(w * scale), int(h * scale)
    left, top = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    return left, top, left + cw, top + ch


def build_instance_queries(catalogue_url: str, out_dir: str, prefix: str = "", seed: int = 0) -> dict:
    """Instance-level set: each catalogue image under ``prefix`` is cropped, flipped and colour-shifted
    into new query images (not in the catalogue); the one relevant item is the original."""
    listing = list_catalogue(catalogue_url)
    catalogue = Location(listing.catalogue, follow_links=True)
    target = Location(out_dir)
    rng = np.random.default_rng(seed)
    queries = []
    for obj in listing.objects:
        if not obj.key.startswith(prefix):
            continue
        try:
            image = decode_image(catalogue.read_bytes(obj.key))
        except ValueError:
            continue
        stem = posixpath.splitext(obj.key)[0].replace("/", "__")
        for name, transform in TRANSFORMS.items():
            buffer = io.BytesIO()
            transform(image, rng).save(buffer, "JPEG", quality=90)
            key = f"images/{stem}-{name}.jpg"
            target.write_bytes(key, buffer.getvalue())
            queries.append(LabelledQuery(f"{obj.key}#{name}", [obj.key], image=target.uri(key), cls=name))
    meta = {"kind": "instance", "catalogue": listing.catalogue, "prefix": prefix, "seed": seed,
            "transforms": sorted(TRANSFORMS), "self_match": "not in gallery (new images)"}
    write_query_set(f"{target.url}/queries.jsonl", queries, meta)
    return meta | {"queries": len(queries), "file": f"{target.url}/queries.jsonl"}
