"""Markdown of an evaluation: served vs exact, per class, win/loss, fusion, routing, traffic gain, candidates."""

from __future__ import annotations


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)


def render_eval(report: dict) -> str:
    a = report["a"]
    names = list(a["metrics"])
    lines = [f"## Evaluation on {report['queries']} queries", ""]
    sides = [("a", a)] + ([("b", report["b"])] if "b" in report else [])
    lines += ["| retriever | index | served | " + " | ".join(names) + " |",
              "|---|---|---|" + "---:|" * len(names)]
    for _, side in sides:
        lines.append(f"| {side['alias']} `{side['slug']}` | v{side['version']} `{side['factory']}` | "
                     f"{side['served']} | " + " | ".join(_fmt(side["metrics"][m]) for m in names) + " |")
        lines.append(f"| {side['alias']} exact | same vectors, Flat | exact | "
                     + " | ".join(_fmt(side["exact"][m]) for m in names) + " |")
        lines.append(f"| {side['alias']} served / exact | | | "
                     + " | ".join(_fmt(side["served_over_exact"][m]) for m in names) + " |")
    for _, side in sides:
        if side["per_class"]:
            lines += ["", f"### Per class ({side['alias']}, served)", "",
                      "| class | queries | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
            for cls, values in side["per_class"].items():
                lines.append(f"| {cls} | {values['queries']} | " + " | ".join(_fmt(values[m]) for m in names) + " |")
    if "compare" in report:
        comp = report["compare"]
        lines += ["", f"### {a['alias']} (A) vs {report['b']['alias']} (B)", "",
                  "| metric | both hit | A only | B only | both miss | union ceiling | B - A | 95% CI |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for metric, cells in comp["win_loss"].items():
            c, boot = cells["counts"], comp["bootstrap"][metric]
            lines.append(f"| {metric} | {c['both_hit']} | {c['a_only']} | {c['b_only']} | {c['both_miss']} | "
                         f"{cells['union_ceiling']:.4f} | {boot['difference']:+.4f} | "
                         f"[{boot['low']:+.4f}, {boot['high']:+.4f}] |")
        fusion = comp["fusion"]
        fnames = [m for m in fusion["a"]]
        lines += ["", "### Fusion", "", "| retriever | " + " | ".join(fnames) + " |", "|---|" + "---:|" * len(fnames)]
        for name in ("a", "b", "rrf", "calibrated", "max"):
            if name in fusion:
                lines.append(f"| {name} | " + " | ".join(_fmt(fusion[name][m]) for m in fnames) + " |")
        lines += ["", f"_{fusion['note']}._"]
        for label, boot in comp.get("fusion_bootstrap", {}).items():
            lines.append(f"\n{label}: {boot['difference']:+.4f}, 95% CI [{boot['low']:+.4f}, {boot['high']:+.4f}]")
        if comp.get("routing"):
            metric = report["metric"]
            lines += ["", f"### Routing by query class ({metric})", "",
                      "| class | queries | a | b | rrf | calibrated | route | route - a | 95% CI |",
                      "|---|---:|---:|---:|---:|---:|---|---:|---|"]
            for cls, entry in comp["routing"].items():
                m, boot = entry[metric], entry["route_minus_a"]
                lines.append(f"| {cls} | {entry['queries']} | " + " | ".join(_fmt(m[n]) for n in
                                                                           ("a", "b", "rrf", "calibrated"))
                             + f" | **{entry['route']}** | {boot['difference']:+.4f} | "
                               f"[{boot['low']:+.4f}, {boot['high']:+.4f}] |")
    if "traffic" in report:
        t = report["traffic"]
        lines += ["", f"### Traffic-weighted gain of routing over A ({t['metric']}, `{t['file']}`)", "",
                  f"**{t['weighted_gain']:+.4f}** over the {t['traffic_covered']:.0%} of traffic whose classes the "
                  "query set has (share x per-class gain, summed).", "", "| class | share | route | gain |",
                  "|---|---:|---|---:|"]
        for row in t["classes"]:
            gain = "not in the query set" if row["gain"] is None else f"{row['gain']:+.4f}"
            lines.append(f"| {row['class']} | {row['share']:.1%} | {row['route'] or '-'} | {gain} |")
    if "candidates" in report:
        lines += ["", render_candidates(report["candidates"])]
    return "\n".join(lines) + "\n"


def candidates_table(result: dict) -> list[dict]:
    """One row per model of `eval --candidates`: the markdown's rows and the table artifact's."""
    table = []
    for row in result["models"]:
        out = {"model": row["name"], "role": row["role"], "model_id": row["model_id"], "d": row["d"]}
        out.update({metric: round(value, 4) for metric, value in row["recall"].items()})
        for metric in row["recall"]:
            boot = (row["vs_alias"] or {}).get(metric)
            out[f"{metric} - {result['alias']} (95% CI)"] = "-" if boot is None else \
                f"{boot['difference']:+.4f} [{boot['low']:+.4f}, {boot['high']:+.4f}]"
        out["runs on"] = row.get("runtime", "-")
        out["encode ms/image"] = row["encode_ms_per_image"]
        out[f"hours for {result['catalogue_items']:,}"] = row["projected_hours"]
        table.append(out)
    return table


def render_candidates(result: dict) -> str:
    """The model choice as one table: recall on the sample, the paired interval against the alias's model, encode
    cost per image here and at the catalogue's size."""
    rows, sample = candidates_table(result), result["sample"]
    columns = list(rows[0])
    lines = [f"### Candidate models against {result['alias']} (`{result['slug']}`)", "",
             f"{result['queries']} queries, searched exactly over one sample of {sample['items']:,} live items "
             f"({sample['relevant']:,} relevant, the others drawn with seed {sample['seed']}; {sample['unreadable']} "
             f"unreadable left out) of the catalogue's {result['catalogue_items']:,}; encoded on {result['device']}.",
             "", "| " + " | ".join(columns) + " |",
             "|" + "|".join("---" if c in ("model", "role", "model_id", "runs on") else "---:" for c in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(f"`{v}`" if c == "model_id" else f"{v:.4f}" if c.startswith("recall@")
                                       and isinstance(v, float) else "-" if v is None else str(v)
                                       for c, v in row.items()) + " |")
    lines += ["", f"_{result['note']}._"]
    return "\n".join(lines)
