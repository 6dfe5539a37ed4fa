"""An unusual night: each watched figure of a night against the median of the nights before it.

The rule, per figure (RULES): with at least MIN_NIGHTS earlier nights, a figure is marked when it is past
`factor` times their median in its bad direction AND differs from the median by at least `floor` (so a
median of zero still needs a real change, and noise around a tiny median is not news). Throughput is only
judged on nights that encoded at least MIN_ENCODED images: a handful of images says nothing about speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median

MIN_NIGHTS = 2  # two clean nights are enough history for a broken third one to stand out
MIN_ENCODED = 50


@dataclass(frozen=True)
class Rule:
    figure: str  # a key of the history row; "a.b" reaches into a nested figure
    worse: str  # "above" or "below"
    factor: float
    floor: float
    meaning: str


RULES = (
    Rule("rejected_share", "above", 3.0, 0.2, "rejected images far above their recent median (share of new and "
                                              "changed images)"),
    Rule("images_per_second", "below", 0.5, 0.0, "throughput far below its recent median"),
    Rule("seconds.ingest", "above", 3.0, 300.0, "ingest wall time far above its recent median"),
    Rule("drift.score", "above", 2.0, 0.1, "new images far from what the index was trained on"),
)


def figure(row: dict, path: str) -> float | None:
    value = row
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def unusual(row: dict, earlier: list[dict]) -> list[dict]:
    """The figures of `row` its earlier nights mark as unusual, each with its value, median and rule."""
    marks = []
    for rule in RULES:
        if rule.figure == "images_per_second" and row.get("encoded", 0) < MIN_ENCODED:
            continue
        history = [v for r in earlier
                   if (v := figure(r, rule.figure)) is not None
                   and (rule.figure != "images_per_second" or r.get("encoded", 0) >= MIN_ENCODED)]
        value = figure(row, rule.figure)
        if value is None or len(history) < MIN_NIGHTS:
            continue
        mid = median(history)
        far = value > rule.factor * mid if rule.worse == "above" else value < rule.factor * mid
        if far and abs(value - mid) >= rule.floor:
            marks.append({"figure": rule.figure, "value": value, "median": round(mid, 4), "nights": len(history),
                          "rule": f"{rule.worse} {rule.factor:g} x median (and >= {rule.floor:g} from it)",
                          "meaning": rule.meaning})
    return marks
