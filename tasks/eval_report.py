"""Markdown for evaluation reports: the numbers a careful engineer would put on the slide."""

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
        for name in ("a", "b", "rrf", "max"):
            lines.append(f"| {name} | " + " | ".join(_fmt(fusion[name][m]) for m in fnames) + " |")
        lines += ["", f"_{fusion['note']}._"]
    return "\n".join(lines) + "\n"
