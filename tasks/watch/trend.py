"""The nightly trend: the last nights of each model as a table (unusual figures marked) and a chart."""

from __future__ import annotations

from imgest.plots import line_chart_png, markdown_image

COLUMNS = (  # header, how to read the figure from a history row, the outlier rule's figure it is marked by
    ("date", lambda r: r["date"], None),
    ("listed", lambda r: r["listed"], None),
    ("new", lambda r: r["new"], None),
    ("changed", lambda r: r["changed"], None),
    ("deleted", lambda r: r["deleted"], None),
    ("rejected", lambda r: f"{r['rejected']} ({r['rejected_share']:.0%})", "rejected_share"),
    ("images/s", lambda r: r["images_per_second"], "images_per_second"),
    ("ingest s", lambda r: r["seconds"]["ingest"], "seconds.ingest"),
    ("index", lambda r: "-" if not r["index"] else f"v{r['index']['version']:04d} {r['index']['method']}", None),
    ("recall", lambda r: "-" if not r["recall"] else
     f"{r['recall']['value']:.3f}" + ("" if r["recall"]["met"] else " (below target)"), None),
    ("shards MiB", lambda r: f"{r['shard_bytes'] / 2**20:.1f}", None),
    ("drift", lambda r: "-" if not r.get("drift") else f"{r['drift']['score']:.3f}", "drift.score"),
)


def trend_rows(rows: list[dict]) -> list[dict]:
    """The rows as printed: every column's text, a figure its rule marks shown as `!value`."""
    out = []
    for row in rows:
        marked = {m["figure"] for m in row.get("marks", [])}
        out.append({"model": row["slug"], **{name: (f"!{get(row)}" if rule in marked else get(row))
                                             for name, get, rule in COLUMNS}})
    return out


def render_trend(rows: list[dict]) -> str:
    """Markdown: a table per model, oldest night first, marked figures in bold with why, then a chart."""
    if not rows:
        return "No nightly history yet: it is written by each nightly run.\n"
    lines = ["# imgest nightly trend", ""]
    for slug in dict.fromkeys(r["slug"] for r in rows):
        mine = [r for r in rows if r["slug"] == slug]
        lines += [f"## `{slug}`: last {len(mine)} night(s)", "",
                  "| " + " | ".join(name for name, _, _ in COLUMNS) + " |",
                  "|---|" + "---:|" * (len(COLUMNS) - 1)]
        for printed in trend_rows(mine):
            cells = [str(printed[name]) for name, _, _ in COLUMNS]
            lines.append("| " + " | ".join(f"**{c[1:]}**" if c.startswith("!") else c for c in cells) + " |")
        notes = [f"- {r['date']}: {m['meaning']}: {m['value']:g} against a median of {m['median']:g} over "
                 f"{m['nights']} night(s)" for r in mine for m in r.get("marks", [])]
        lines += ["", *notes, "" if notes else "",
                  markdown_image(trend_png(mine), f"trend of {slug}"), ""]
    return "\n".join(lines)


def trend_png(rows: list[dict]) -> bytes:
    dates = [r["date"] + ("" if sum(x["date"] == r["date"] for x in rows) == 1 else f" {r['finished'][11:16]}")
             for r in rows]
    return line_chart_png(dates, {
        "images/s": [r["images_per_second"] for r in rows],
        "rejected share": [r["rejected_share"] for r in rows],
        "recall@k": [r["recall"]["value"] if r["recall"] else None for r in rows],
    }, title=f"{rows[-1]['slug']}: last {len(rows)} night(s)")
