"""Duplicate images in a catalogue: exact (the same bytes under different keys) and near (embeddings of
one image model within a cosine threshold: re-encodes, resizes, crops of one photo; or, where the model's
calibration says its embedding is weak, a nearest neighbour whose perceptual hash is within a few bits).

Exact groups come from the content hashes of the live rows (grouped in DuckDB). Near groups are found by
searching the model's served index with every live vector, shard by shard (its k nearest; a range search is not
offered by every index kind, HNSW among them), keeping pairs at or above the threshold, and joining pairs into
groups (connected components, union-find over the items that have a duplicate: tasks/duplicates/scan.py).
Each pair says which signal found it. A report is a Parquet table, one row per grouped item, written to
`duplicates/model=<slug>/<run>.parquet`; the next report says which groups are new since the last.
"""

from __future__ import annotations

import io
import json
import logging
from dataclasses import dataclass, field

import pyarrow as pa

from imgest.state.catalogue_images import CatalogueImages, CatalogueRootError
from imgest.state.clock import now_iso
from imgest.storage import Location, StorageError

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
    """Union-find over the items that have a duplicate (exact or near): the rest of the catalogue never enters."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, a: str) -> str:
        self.parent.setdefault(a, a)
        while self.parent[a] != a:
            self.parent[a] = self.parent[self.parent[a]]
            a = self.parent[a]
        return a

    def join(self, a: str, b: str) -> None:
        a, b = self.find(a), self.find(b)
        if a != b:
            self.parent[max(a, b)] = min(a, b)


def find_duplicates(hashes: dict[str, str], pairs: dict[tuple[str, str], tuple[float, str]], confirm=None,
                    refused: list | None = None) -> list[dict]:
    """Groups of two or more items, largest first: exact when every member has the same bytes, else near.
    `hashes`: the content hash of every item that shares its bytes with another live item or is in a pair (the
    catalogue's other items play no part); `pairs`: (item, item) -> (cosine, signal) of the near pairs (the
    signal that found each: embedding or hash). With `confirm` (item, item) -> bool, a near pair joins only when
    it says so (the others go to `refused`)."""
    sets = _Sets()
    first: dict[str, str] = {}
    for item, content_hash in sorted(hashes.items()):
        sets.find(item)
        if content_hash in first:
            sets.join(item, first[content_hash])
        else:
            first[content_hash] = item
    found = dict(pairs)
    if confirm is not None:
        for pair in [pair for pair in found if not confirm(*pair)]:
            del found[pair]
            if refused is not None:
                refused.append(pair)
    for a, b in found:
        sets.join(a, b)
    members: dict[str, list[str]] = {}
    for item in hashes:
        members.setdefault(sets.find(item), []).append(item)
    joined_by: dict[str, list[tuple[str, str]]] = {}
    for pair in found:
        joined_by.setdefault(sets.find(pair[0]), []).append(pair)
    groups = []
    for root, items in members.items():
        if len(items) < 2:
            continue
        joined = sorted(joined_by.get(root, []))
        groups.append({"kind": "exact" if len({hashes[i] for i in items}) == 1 else "near", "items": sorted(items),
                       "min_score": round(min((found[p][0] for p in joined), default=1.0), 4),
                       "pairs": [{"items": [a, b], "score": round(found[(a, b)][0], 4), "signal": found[(a, b)][1]}
                                 for a, b in joined]})
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

    from imgest.images.decode import decode_image

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
    from imgest.plots import markdown_image

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


def find_and_report(store: Location, report: DuplicateReport, hashes: dict[str, str], uris: dict[str, str],
                    pairs: dict[tuple[str, str], tuple[float, str]], run: str, fence=None, confirm=None) -> dict:
    """Group, compare with the last report, write the report (fenced), return it with the artifact's text.
    `hashes` and `uris`: those of the items in an exact group or a pair."""
    refused: list = []
    report.groups = find_duplicates(hashes, pairs, confirm, refused)
    report.refused_pairs = len(refused) if confirm is not None else None
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
