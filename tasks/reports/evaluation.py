"""Markdown of an evaluation: served vs exact, per class, win/loss, fusion, routing, traffic gain."""

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
    return "\n".join(lines) + "\n"
