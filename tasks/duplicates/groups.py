"""Duplicate images in a catalogue: exact (the same bytes under different keys) and near (embeddings of
one image model within a cosine threshold: re-encodes, resizes, crops of one photo; or, where the model's
calibration says its embedding is weak, a nearest neighbour whose perceptual hash is within a few bits).

Exact groups come from the content hashes of the live rows. Near groups are found by searching the
model's served index with every live vector (its k nearest; a range search is not offered by every index
kind, HNSW among them), keeping pairs at or above the threshold, and joining pairs into groups
(connected components, union-find). Each pair says which signal found it. A report is a Parquet table, one
row per grouped item, written to `duplicates/model=<slug>/<run>.parquet`; the next report says which
groups are new since the last.
"""

from __future__ import annotations

import io
import json
import logging
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

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
    threshold_source: str = "--threshold"  # --threshold, calibration or default
    calibration: dict | None = None  # the calibration's figures at this threshold (recall, precision, sample)
    groups: list[dict] = field(default_factory=list)  # {"kind", "items", "min_score", "pairs"}
    refused_pairs: int | None = None  # near pairs the picture check refused (None: no check)
    new_groups: int = 0
    key: str = ""

    def to_dict(self) -> dict:
        return {"slug": self.slug, "model_id": self.model_id, "threshold": self.threshold,
                "threshold_source": self.threshold_source, "calibration": self.calibration, "items": self.items,
                "groups": self.groups, "new_groups": self.new_groups, "key": self.key,
                "refused_pairs": self.refused_pairs,
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
                    threshold: float, hash_pairs=(), confirm=None, refused: list | None = None) -> list[dict]:
    """Groups of two or more items, largest first: exact when every member has the same bytes, else near.
    `scores`/`neighbours`: each item's k nearest (faiss ids into item_ids), as the index returned them;
    `hash_pairs`: (row, row, cosine) pairs the perceptual hash found below the threshold. With `confirm`
    (row, row) -> bool, a near pair joins only when it says so (the others go to `refused`). Each near group
    lists its pairs with the signal that found each: embedding or hash."""
    sets = _Sets(len(item_ids))
    by_hash: dict[str, int] = {}
    for n, content_hash in enumerate(hashes):
        if content_hash in by_hash:
            sets.join(n, by_hash[content_hash])
        else:
            by_hash[content_hash] = n
    found: dict[tuple[int, int], tuple[float, str]] = {}
    for n, (row_scores, row_ids) in enumerate(zip(scores, neighbours)):
        for score, m in zip(row_scores, row_ids):
            if m >= 0 and m != n and score >= threshold and hashes[m] != hashes[n]:  # equal bytes: joined above
                found[(min(n, int(m)), max(n, int(m)))] = (float(score), "embedding")
    for n, m, score in hash_pairs:
        found.setdefault((min(n, m), max(n, m)), (float(score), "hash"))
    if confirm is not None:
        for pair in [pair for pair in found if not confirm(*pair)]:
            del found[pair]
            if refused is not None:
                refused.append((item_ids[pair[0]], item_ids[pair[1]]))
    for a, b in found:
        sets.join(a, b)
    members: dict[int, list[int]] = {}
    for n in range(len(item_ids)):
        members.setdefault(sets.find(n), []).append(n)
    pairs: dict[int, list[tuple[int, int]]] = {}
    for pair in found:
        pairs.setdefault(sets.find(pair[0]), []).append(pair)
    groups = []
    for root, rows in members.items():
        if len(rows) < 2:
            continue
        exact = len({hashes[r] for r in rows}) == 1
        joined = sorted(pairs.get(root, []), key=lambda p: (item_ids[p[0]], item_ids[p[1]]))
        groups.append({"kind": "exact" if exact else "near", "items": sorted(item_ids[r] for r in rows),
                       "min_score": round(min((found[p][0] for p in joined), default=1.0), 4),
                       "pairs": [{"items": [item_ids[a], item_ids[b]], "score": round(found[(a, b)][0], 4),
                                  "signal": found[(a, b)][1]} for a, b in joined]})
    return sorted(groups, key=lambda g: (-len(g["items"]), g["items"]))


def found_by(group: dict) -> str:
    """Which signals joined a group: bytes (exact), embedding, hash, or embedding+hash."""
    signals = sorted({pair["signal"] for pair in group["pairs"]})
    return "+".join(signals) if signals else "bytes"


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
    rows = [{"group": n, "kind": g["kind"], "found_by": found_by(g), "item_id": item, "uri": uris.get(item),
             "min_score": g["min_score"]} for n, g in enumerate(report.groups) for item in g["items"]]
    schema = pa.schema([("group", pa.int32()), ("kind", pa.string()), ("found_by", pa.string()),
                        ("item_id", pa.string()), ("uri", pa.string()), ("min_score", pa.float32())])
    table = pa.Table.from_pylist(rows, schema=schema).replace_schema_metadata({
        "imgest.model_id": report.model_id, "imgest.threshold": str(report.threshold),
        "imgest.threshold_source": report.threshold_source,
        "imgest.calibration": json.dumps(report.calibration, sort_keys=True),
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


def describe_threshold(report: dict) -> str:
    """One sentence: the threshold, where it came from, and what it was measured to find."""
    source = {"calibration": "calibrated on this catalogue", "--threshold": "set by --threshold",
              "default": "the fixed default: no calibration could be measured"}.get(report["threshold_source"],
                                                                                    report["threshold_source"])
    text = f"near-duplicate threshold cosine >= {report['threshold']} ({source})"
    c = report["calibration"]
    if c:
        text += (f"; measured on {c['sample']} sampled images and {c['planted_pairs']} planted copies: recall "
                 f"{c['recall']:.0%} of planted copies, precision {c['precision']:.0%} against each image's nearest "
                 "other item")
        signal = c.get("hash_signal")
        if signal:
            text += (f"; the embedding is weak here, so a neighbour scoring >= {signal['floor']} whose perceptual "
                     f"hash is within {signal['hash_distance']} bits is a duplicate too: together recall "
                     f"{signal['recall']:.0%}, precision {signal['precision']:.0%}")
    if report.get("refused_pairs") is not None:
        text += (f"; each near pair was confirmed by comparing the two pictures ({report['refused_pairs']} "
                 "refused as different pictures"
                 + (f"; the check passes {c['confirmed']:.0%} of planted copies)" if c else ")"))
    return text


def describe_report(report: dict) -> str:
    """The command line's summary of a report (its JSON form)."""
    return (f"{report['items']:,} items of {report['model_id']}: {report['exact_groups']} exact groups, "
            f"{report['near_groups']} near groups, {report['new_groups']} new; report {report['key']}\n"
            f"{describe_threshold(report)}")


def render_duplicates(report: DuplicateReport, thumbnails: dict[int, bytes]) -> str:
    from imgest.tasks.reports.plots import markdown_image

    counts = report.to_dict()
    lines = [f"# Duplicates: model={report.slug}", "",
             f"{report.items:,} live items of `{report.model_id}`; {describe_threshold(counts)}. "
             f"**{counts['exact_groups']} exact groups** (same bytes under different keys), "
             f"**{counts['near_groups']} near groups**, {report.new_groups} new since the last report. "
             f"Report: `{report.key}`.", "",
             "| group | kind | found by | items | lowest cosine | images |", "|---|---|---|---|---|---|"]
    for n, group in enumerate(report.groups[:50]):
        shown = ", ".join(f"`{i}`" for i in group["items"][:5]) + (" ..." if len(group["items"]) > 5 else "")
        image = markdown_image(thumbnails[n], f"group {n}") if n in thumbnails else ""
        lines.append(f"| {n} | {group['kind']} | {found_by(group)} | {shown} | {group['min_score']} | {image} |")
    if len(report.groups) > 50:
        lines.append(f"\n{len(report.groups) - 50} more groups in the Parquet report.")
    return "\n".join(lines)


def find_and_report(store: Location, report: DuplicateReport, live, scores: np.ndarray, neighbours: np.ndarray,
                    hash_pairs, run: str, fence=None, confirm=None) -> dict:
    """Group, compare with the last report, write the report (fenced), return it with the artifact's text."""
    refused: list = []
    report.groups = find_duplicates(live.item_ids, live.content_hashes, scores, neighbours, report.threshold,
                                    hash_pairs, confirm, refused)
    report.refused_pairs = len(refused) if confirm is not None else None
    uris = dict(zip(live.item_ids, live.uris))
    before = previous_groups(store, report.slug)
    report.new_groups = sum(1 for g in report.groups if tuple(g["items"]) not in before)
    if fence is not None:
        fence.check(store)
    write_report(store, report, uris, run)
    try:
        read = CatalogueImages(store, report.slug).read
    except (CatalogueRootError, StorageError) as exc:  # the report stands without its pictures
        logging.getLogger("imgest").warning("duplicate groups shown without thumbnails: %s", exc)
        read = None
    thumbnails = {n: thumbnail_strip([uris[i] for i in g["items"]], read) for n, g in enumerate(report.groups[:10])
                  if read is not None}
    return {**report.to_dict(), "markdown": render_duplicates(report, thumbnails)}
