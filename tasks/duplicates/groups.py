"""Duplicate images in a catalogue: exact (the same bytes under different keys) and near (embeddings of
one image model within a cosine threshold: re-encodes, resizes, crops of one photo).

Exact groups come from the content hashes of the live rows. Near groups are found by searching the
model's served index with every live vector (its k nearest; a range search is not offered by every index
kind, HNSW among them), keeping pairs at or above the threshold, and joining pairs into groups
(connected components, union-find). A report is a Parquet table, one row per grouped item, written to
`duplicates/model=<slug>/<run>.parquet`; the next report says which groups are new since the last.
"""

from __future__ import annotations

import io
import json
import logging
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

from imgest.lock import Fence
from imgest.storage import Location, StorageError
from imgest.tasks.state.catalogue_images import CatalogueImages, CatalogueRootError
from imgest.tasks.state.committed import now_iso

NEIGHBOURS = 16  # candidates per item; a group larger than this still joins up through its members


@dataclass
class DuplicateReport:
    slug: str
    model_id: str
    threshold: float
    items: int
    groups: list[dict] = field(default_factory=list)  # {"kind", "items", "min_score"}
    new_groups: int = 0
    key: str = ""

    def to_dict(self) -> dict:
        return {"slug": self.slug, "model_id": self.model_id, "threshold": self.threshold, "items": self.items,
                "groups": self.groups, "new_groups": self.new_groups, "key": self.key,
                "exact_groups": sum(1 for g in self.groups if g["kind"] == "exact"),
                "near_groups": sum(1 for g in self.groups if g["kind"] == "near")}


class _Sets:
    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, a: int) -> int:
        while self.parent[a] != a:
            self.parent[a] = self.parent[self.parent[a]]
            a = self.parent[a]
        return a

    def join(self, a: int, b: int) -> None:
        a, b = self.find(a), self.find(b)
        if a != b:
            self.parent[max(a, b)] = min(a, b)


def find_duplicates(item_ids: list[str], hashes: list[str], scores: np.ndarray, neighbours: np.ndarray,
                    threshold: float) -> list[dict]:
    """Groups of two or more items, largest first: exact when every member has the same bytes, else near.
    `scores`/`neighbours`: each item's k nearest (faiss ids into item_ids), as the index returned them."""
    sets = _Sets(len(item_ids))
    by_hash: dict[str, int] = {}
    for n, content_hash in enumerate(hashes):
        if content_hash in by_hash:
            sets.join(n, by_hash[content_hash])
        else:
            by_hash[content_hash] = n
    weakest: dict[tuple[int, int], float] = {}
    for n, (row_scores, row_ids) in enumerate(zip(scores, neighbours)):
        for score, m in zip(row_scores, row_ids):
            if m >= 0 and m != n and score >= threshold:
                sets.join(n, int(m))
                weakest[(min(n, m), max(n, m))] = float(score)
    members: dict[int, list[int]] = {}
    for n in range(len(item_ids)):
        members.setdefault(sets.find(n), []).append(n)
    lowest: dict[int, float] = {}
    for (a, _), score in weakest.items():
        root = sets.find(a)
        lowest[root] = min(lowest.get(root, 1.0), score)
    groups = []
    for root, rows in members.items():
        if len(rows) < 2:
            continue
        exact = len({hashes[r] for r in rows}) == 1
        groups.append({"kind": "exact" if exact else "near", "items": sorted(item_ids[r] for r in rows),
                       "min_score": round(lowest.get(root, 1.0), 4)})
    return sorted(groups, key=lambda g: (-len(g["items"]), g["items"]))


def report_key(slug: str, run: str) -> str:
    return f"duplicates/model={slug}/{run}.parquet"


def previous_groups(store: Location, slug: str) -> set[tuple[str, ...]]:
    names = sorted(n for n in store.list_names(f"duplicates/model={slug}") if n.endswith(".parquet"))
    if not names:
        return set()
    table = store.read_table(f"duplicates/model={slug}/{names[-1]}", columns=["group", "item_id"])
    groups: dict[int, list[str]] = {}
    for group, item in zip(table.column("group").to_pylist(), table.column("item_id").to_pylist()):
        groups.setdefault(group, []).append(item)
    return {tuple(sorted(items)) for items in groups.values()}


def write_report(store: Location, report: DuplicateReport, uris: dict[str, str], run: str) -> str:
    rows = [{"group": n, "kind": g["kind"], "item_id": item, "uri": uris.get(item), "min_score": g["min_score"]}
            for n, g in enumerate(report.groups) for item in g["items"]]
    schema = pa.schema([("group", pa.int32()), ("kind", pa.string()), ("item_id", pa.string()),
                        ("uri", pa.string()), ("min_score", pa.float32())])
    table = pa.Table.from_pylist(rows, schema=schema).replace_schema_metadata({
        "imgest.model_id": report.model_id, "imgest.threshold": str(report.threshold),
        "imgest.items": str(report.items), "imgest.created": now_iso(),
        "imgest.groups": json.dumps({"exact": sum(g["kind"] == "exact" for g in report.groups),
                                     "near": sum(g["kind"] == "near" for g in report.groups)})})
    report.key = report_key(report.slug, run)
    store.write_table(report.key, table)
    return report.key


def thumbnail_strip(uris: list[str], read=None, side: int = 96) -> bytes:
    """One PNG of the group's images side by side (the artifact shows what was grouped); ``read`` gives an
    image's bytes (`CatalogueImages.read`: only under the model's catalogue root)."""
    from PIL import Image

    from imgest.tasks.ingest.decode import decode_image

    tiles = []
    for uri in uris[:6]:
        try:
            image = decode_image(read(uri), min_side=side)
        except Exception:  # noqa: BLE001 - a thumbnail that cannot be made is left out, the report stands
            continue
        image.thumbnail((side, side))
        tiles.append(image)
    strip = Image.new("RGB", (max(1, len(tiles)) * (side + 4), side + 4), "white")
    for n, tile in enumerate(tiles):
        strip.paste(tile, (n * (side + 4) + 2, 2))
    buf = io.BytesIO()
    strip.save(buf, "PNG")
    return buf.getvalue()


def duplicates_of(store_url: str, alias: str | None, model: str | None, threshold: float) -> tuple[DuplicateReport,
                                                                                                   dict[str, str]]:
    """Every live item of the model behind `alias` (or `model`) searched against its served index."""
    from imgest.tasks.search.query import Searcher, SearchError
    from imgest.tasks.state.live import load_live_vectors

    searcher = Searcher(store_url, alias, model)
    card, opened = searcher.card, searcher.opened
    if "image" not in searcher.spec.modalities:
        raise SearchError(f"{card['model_name']} is a text model: duplicates are found with an image model's index")
    live = load_live_vectors(searcher.store, card["slug"], searcher.spec.dim)
    position = {item: n for n, item in enumerate(live.item_ids)}
    indexed = [position.get(item, -1) for item in opened.item_ids]  # faiss id -> live row (-1: gone since)
    scores, ids = opened.search(live.vectors, min(NEIGHBOURS, max(1, opened.index.ntotal)))
    neighbours = np.where(ids >= 0, np.asarray(indexed + [-1], np.int64)[ids], -1)
    groups = find_duplicates(live.item_ids, live.content_hashes, scores, neighbours, threshold)
    report = DuplicateReport(card["slug"], card["model_id"], threshold, len(live), groups)
    return report, dict(zip(live.item_ids, live.uris))


def render_duplicates(report: DuplicateReport, thumbnails: dict[int, bytes]) -> str:
    from imgest.tasks.reports.plots import markdown_image

    counts = report.to_dict()
    lines = [f"# Duplicates: model={report.slug}", "",
             f"{report.items:,} live items of `{report.model_id}`; near-duplicate threshold cosine >= "
             f"{report.threshold}. **{counts['exact_groups']} exact groups** (same bytes under different keys), "
             f"**{counts['near_groups']} near groups**, {report.new_groups} new since the last report. "
             f"Report: `{report.key}`.", "",
             "| group | kind | items | lowest cosine | images |", "|---|---|---|---|---|"]
    for n, group in enumerate(report.groups[:50]):
        shown = ", ".join(f"`{i}`" for i in group["items"][:5]) + (" ..." if len(group["items"]) > 5 else "")
        image = markdown_image(thumbnails[n], f"group {n}") if n in thumbnails else ""
        lines.append(f"| {n} | {group['kind']} | {shown} | {group['min_score']} | {image} |")
    if len(report.groups) > 50:
        lines.append(f"\n{len(report.groups) - 50} more groups in the Parquet report.")
    return "\n".join(lines)


def find_and_report(store_url: str, alias: str | None, model: str | None, threshold: float, fence=None) -> dict:
    """Find, compare with the last report, write the report (fenced), return it with the artifact's text."""
    from datetime import UTC, datetime

    report, uris = duplicates_of(store_url, alias, model, threshold)
    store = Location(store_url)
    before = previous_groups(store, report.slug)
    report.new_groups = sum(1 for g in report.groups if tuple(g["items"]) not in before)
    if fence is not None:
        fence.check(store)
    write_report(store, report, uris, datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f"))
    try:
        read = CatalogueImages(store, report.slug).read
    except (CatalogueRootError, StorageError) as exc:  # the report stands without its pictures
        logging.getLogger("imgest").warning("duplicate groups shown without thumbnails: %s", exc)
        read = None
    thumbnails = {n: thumbnail_strip([uris[i] for i in g["items"]], read) for n, g in enumerate(report.groups[:10])
                  if read is not None}
    return {**report.to_dict(), "markdown": render_duplicates(report, thumbnails)}


@task(name="find-duplicates", cache_policy=NO_CACHE)
def find_duplicates_task(store_url: str, alias: str | None, model: str | None, threshold: float,
                         fence: Fence | None = None) -> dict:
    return find_and_report(store_url, alias, model, threshold, fence)
