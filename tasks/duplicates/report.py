"""A duplicates run's report: its groups written to Parquet by DuckDB as they are joined with the items' names
(a row per member, never a Python object per item), the groups new since the last report, and what people read of
it: the counts, the first groups, the artifact.

  duplicates/model=<slug>/<run>.parquet        group, kind, found_by, item_id, uri, min_score, content_hash: a row
                                               per member in group order (largest group first); the footer says
                                               what made it (model, threshold and its source, calibration, counts)
  duplicates/pairs/model=<slug>/<run>.parquet  group, a, b, score, signal: the near pairs that joined the groups
"""

from __future__ import annotations

import io
import json
import logging
import os
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from imgest.state import layout
from imgest.state.clock import now_iso
from imgest.state.layout import duplicate_pairs_key as pairs_key
from imgest.state.layout import duplicates_prefix
from imgest.state.layout import duplicates_report_key as report_key
from imgest.state.rows import scratch_sql, sql_string
from imgest.storage import Location, StorageError
from imgest.tasks.duplicates.groups import SIGNALS, Groups, found_by
from imgest.tasks.duplicates.scan import Candidates

GROUPS_SHOWN = 20  # groups the summary (--json, the command's lines, the artifact) lists; the report holds all
ITEMS_SHOWN = 50  # members listed per group shown (its size counts them all)
PAIRS_SHOWN = 50  # pairs listed per group shown


@dataclass
class DuplicateReport:
    slug: str
    model_id: str
    threshold: float
    items: int
    threshold_source: str = "--threshold"  # --threshold, calibration or default
    calibration: dict | None = None  # the calibration's figures at this threshold (recall, precision, sample)
    refused_pairs: int | None = None  # near pairs the picture check refused (None: no check)
    exact_groups: int = 0
    near_groups: int = 0
    exact_items: int = 0  # members of exact groups
    near_items: int = 0  # members of near groups
    pairs: int = 0  # near pairs that joined a group
    new_groups: int = 0
    key: str = ""  # the report, in the store
    pairs_key: str = ""  # the pairs that joined its groups, in the store
    url: str = ""  # the report's full location
    groups: list[dict] = field(default_factory=list)  # the first GROUPS_SHOWN groups

    def to_dict(self) -> dict:
        return {"slug": self.slug, "model_id": self.model_id, "threshold": self.threshold,
                "threshold_source": self.threshold_source, "calibration": self.calibration, "items": self.items,
                "exact_groups": self.exact_groups, "near_groups": self.near_groups,
                "grouped_items": self.exact_items + self.near_items, "exact_items": self.exact_items,
                "near_items": self.near_items, "pairs": self.pairs, "refused_pairs": self.refused_pairs,
                "new_groups": self.new_groups, "key": self.key, "pairs_key": self.pairs_key, "url": self.url,
                "groups_shown": len(self.groups), "groups": self.groups}


def _cases(column: str, names: dict[int, str]) -> str:
    return f"CASE {column} " + " ".join(f"WHEN {k} THEN {sql_string(v)}" for k, v in names.items()) + " END"


def _write_files(found: Candidates, groups: Groups, a: np.ndarray, b: np.ndarray, score: np.ndarray,
                 signal: np.ndarray, folder: str, metadata: dict[str, str]) -> tuple[str, str]:
    """The report and its pairs as local Parquet files, written by DuckDB (memory capped, spilling)."""
    report, pairs = os.path.join(folder, "report.parquet"), os.path.join(folder, "report-pairs.parquet")
    items = f"read_parquet({sql_string(found.items)})"
    codes = np.nonzero(groups.of_item >= 0)[0].astype(np.int32)
    footer = "{" + ", ".join(f"{sql_string(k)}: {sql_string(v)}" for k, v in metadata.items()) + "}"
    with scratch_sql(folder) as con:
        con.register("members", pa.table({"code": codes, "group": groups.of_item[codes]}))
        con.register("groups", pa.table({"group": np.arange(len(groups), dtype=np.int32), "exact": groups.exact,
                                         "signals": groups.signals, "min_score": groups.min_score}))
        con.register("joined", pa.table({"group": groups.pair_group, "a": a, "b": b,
                                         "score": np.asarray(score, np.float32), "signal": signal}))
        kind = _cases("g.exact", {"true": "exact", "false": "near"})
        by = _cases("g.signals", {bits: found_by(bits) for bits in range(1 << len(SIGNALS))})
        con.execute(f"""COPY (SELECT m."group", {kind} AS kind, {by} AS found_by, i.item_id, i.uri, g.min_score,
                                     i.content_hash
                              FROM members AS m JOIN groups AS g USING ("group") JOIN {items} AS i USING (code)
                              ORDER BY m."group", i.item_id)
                        TO {sql_string(report)} (FORMAT parquet, COMPRESSION zstd, KV_METADATA {footer})""")
        signal_name = _cases("p.signal", dict(enumerate(SIGNALS)))
        con.execute(f"""COPY (SELECT p."group", i.item_id AS a, j.item_id AS b, p.score, {signal_name} AS signal
                              FROM joined AS p JOIN {items} AS i ON i.code = p.a JOIN {items} AS j ON j.code = p.b
                              ORDER BY 1, 2, 3)
                        TO {sql_string(pairs)} (FORMAT parquet, COMPRESSION zstd, KV_METADATA {footer})""")
    return report, pairs


def new_groups(store: Location, slug: str, report: str, folder: str) -> int:
    """How many groups of the local report `report` are not a group (the same members) of the store's latest
    report; all of them when there is none, or it is not one imgest wrote."""
    from imgest.storage.cache import local_copy

    names = sorted(n for n in store.list_names(duplicates_prefix(slug)) if n.endswith(".parquet"))
    members = "SELECT list(item_id ORDER BY item_id) AS members FROM read_parquet({}) GROUP BY \"group\""
    with scratch_sql(folder) as con:
        if names:
            import duckdb

            key = layout.file_in(duplicates_prefix(slug), names[-1])
            try:
                before = local_copy(store, key, os.path.join(folder, "before"), checksum=names[-1], suffix=".parquet")
                return con.execute(f"SELECT count(*) FROM ({members.format(sql_string(report))}) ANTI JOIN "
                               f"({members.format(sql_string(before))}) USING (members)").fetchone()[0]
            except (duckdb.Error, StorageError, OSError) as exc:
                logging.getLogger("imgest").warning("%s: %s is not a duplicates report imgest wrote (%s): every "
                                                    "group counts as new", store.url, key, exc)
        return con.execute(f"SELECT count(DISTINCT \"group\") FROM read_parquet({sql_string(report)})").fetchone()[0]


def first_groups(report: str, pairs: str, sizes: np.ndarray, folder: str) -> list[dict]:
    """The first GROUPS_SHOWN groups of the local report, each with its first members and pairs."""
    with scratch_sql(folder) as con:
        shown = con.sql(f"""SELECT "group", any_value(kind) AS kind, any_value(found_by) AS found_by,
                                   any_value(min_score) AS min_score,
                                   list(item_id ORDER BY item_id)[1:{ITEMS_SHOWN}] AS items,
                                   list(uri ORDER BY item_id)[1:{ITEMS_SHOWN}] AS uris
                            FROM read_parquet({sql_string(report)}) WHERE "group" < {GROUPS_SHOWN}
                            GROUP BY "group" ORDER BY "group" """).to_arrow_table().to_pylist()
        joined = con.sql(f"""SELECT "group", a, b, score, signal FROM read_parquet({sql_string(pairs)})
                             WHERE "group" < {GROUPS_SHOWN}
                             QUALIFY row_number() OVER (PARTITION BY "group" ORDER BY a, b) <= {PAIRS_SHOWN}
                             ORDER BY "group", a, b""").to_arrow_table().to_pylist()
    by_group: dict[int, list[dict]] = {}
    for pair in joined:
        by_group.setdefault(pair["group"], []).append({"items": [pair["a"], pair["b"]],
                                                       "score": round(pair["score"], 4), "signal": pair["signal"]})
    return [{"kind": g["kind"], "items": g["items"], "size": int(sizes[g["group"]]), "found_by": g["found_by"],
             "min_score": round(g["min_score"], 4), "pairs": by_group.get(g["group"], []), "uris": g["uris"]}
            for g in shown]


def write_report(store: Location, report: DuplicateReport, found: Candidates, groups: Groups, a: np.ndarray,
                 b: np.ndarray, score: np.ndarray, signal: np.ndarray, run: str, folder: str, fence=None) -> None:
    """Write the report and its pairs (fenced), count the groups new since the last report, and fill `report`'s
    counts and first groups. `a`, `b`, `score`, `signal`: the near pairs that joined (`groups` came from them)."""
    report.exact_groups, report.near_groups = int(groups.exact.sum()), int((~groups.exact).sum())
    report.exact_items = int(groups.size[groups.exact].sum())
    report.near_items = int(groups.size[~groups.exact].sum())
    report.pairs = len(a)
    report.key, report.pairs_key = report_key(report.slug, run), pairs_key(report.slug, run)
    report.url = store.uri(report.key)
    metadata = {"imgest.model_id": report.model_id, "imgest.threshold": str(report.threshold),
                "imgest.threshold_source": report.threshold_source,
                "imgest.calibration": json.dumps(report.calibration, sort_keys=True),
                "imgest.items": str(report.items), "imgest.created": now_iso(),
                "imgest.groups": json.dumps({"exact": report.exact_groups, "near": report.near_groups}),
                "imgest.grouped_items": json.dumps({"exact": report.exact_items, "near": report.near_items}),
                "imgest.pairs": str(report.pairs), "imgest.refused_pairs": json.dumps(report.refused_pairs),
                "imgest.pairs_key": report.pairs_key}
    local, local_pairs = _write_files(found, groups, a, b, score, signal, folder, metadata)
    report.new_groups = new_groups(store, report.slug, local, folder)
    report.groups = first_groups(local, local_pairs, groups.size, folder)
    if fence is not None:
        fence.check(store)
    store.put_file(report.pairs_key, local_pairs)  # first: a report never names pairs that are not there
    store.put_file(report.key, local)


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
    return (f"{report['items']:,} items of {report['model_id']}: {report['exact_groups']:,} exact groups "
            f"({report['exact_items']:,} items), {report['near_groups']:,} near groups ({report['near_items']:,} "
            f"items), {report['new_groups']:,} new; report {report['url']}\n{describe_threshold(report)}")


def describe_group(number: int, group: dict) -> str:
    """A group on one line: number, kind, signals, lowest cosine, its first members."""
    more = f" (+{group['size'] - len(group['items'])} more)" if group["size"] > len(group["items"]) else ""
    return (f"  {number:>4} {group['kind']:5} {group['found_by']:14} {group['min_score']:.4f}  "
            f"{' '.join(group['items'])}{more}")


def render_duplicates(report: DuplicateReport, thumbnails: dict[int, bytes]) -> str:
    from imgest.plots import markdown_image

    counts = report.to_dict()
    lines = [f"# Duplicates: model={report.slug}", "",
             f"{report.items:,} live items of `{report.model_id}`; {describe_threshold(counts)}. "
             f"**{report.exact_groups:,} exact groups** ({report.exact_items:,} items with the same bytes under "
             f"different keys), **{report.near_groups:,} near groups** ({report.near_items:,} items), "
             f"{report.new_groups:,} new since the last report. Report: `{report.url}`.", "",
             "| group | kind | found by | items | lowest cosine | images |", "|---|---|---|---|---|---|"]
    for n, group in enumerate(report.groups):
        shown = ", ".join(f"`{i}`" for i in group["items"][:5]) + (" ..." if group["size"] > 5 else "")
        image = markdown_image(thumbnails[n], f"group {n}") if n in thumbnails else ""
        lines.append(f"| {n} | {group['kind']} | {group['found_by']} | {shown} ({group['size']}) | "
                     f"{group['min_score']} | {image} |")
    more = report.exact_groups + report.near_groups - len(report.groups)
    if more > 0:
        lines.append(f"\n{more:,} more groups in the Parquet report.")
    return "\n".join(lines)


def summary(store: Location, report: DuplicateReport) -> dict:
    """The report's summary with the artifact's text (thumbnails of the first groups, read only under the model's
    catalogue root)."""
    from imgest.state.catalogue_images import CatalogueImages, CatalogueRootError

    try:
        read = CatalogueImages(store, report.slug).read
    except (CatalogueRootError, StorageError) as exc:  # the report stands without its pictures
        logging.getLogger("imgest").warning("duplicate groups shown without thumbnails: %s", exc)
        read = None
    thumbnails = {n: thumbnail_strip(g["uris"], read) for n, g in enumerate(report.groups[:10]) if read is not None}
    return {**report.to_dict(), "markdown": render_duplicates(report, thumbnails)}
