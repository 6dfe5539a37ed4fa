"""PNG plots for reports: recall against the search parameter, a bootstrap distribution, figures over nights."""

from __future__ import annotations

import base64
import io

import matplotlib

matplotlib.use("Agg")  # no display on servers and workers
import matplotlib.pyplot as plt  # noqa: E402


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def recall_sweep_png(card: dict) -> bytes:
    """recall@k and latency against efSearch/nprobe, with the target and the served value marked."""
    sweep = card["recall"]["sweep"]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for factor in dict.fromkeys(p.get("k_factor") for p in sweep):  # one curve per re-rank factor
        points = [p for p in sweep if p.get("k_factor") == factor]
        label = f"recall@{card['recall']['k']}" + (f", k_factor {factor}" if factor is not None else "")
        ax.plot([p["param"] if p["param"] is not None else 0 for p in points], [p["recall"] for p in points], "o-",
                label=label)
    ax.axhline(card["recall"]["target"], color="grey", linestyle="--", label="target")
    if card["search"]["value"] is not None:
        ax.axvline(card["search"]["value"], color="tab:green", linestyle=":", label="served")
        ax.set_xscale("log", base=2)
    ax.set_xlabel(card["search"]["param"] or "exact")
    ax.set_ylabel("recall vs exact")
    ax.set_title(f"{card['factory']} v{card['version']:04d}, N={card['n']}")
    ax.legend(loc="lower right")
    return _png(fig)


def bootstrap_png(boot: dict, metric: str, a: str, b: str) -> bytes:
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.hist(boot["samples"], bins=40, color="tab:blue", alpha=0.8)
    for x, style in ((boot["low"], ":"), (boot["high"], ":"), (0.0, "-")):
        ax.axvline(x, color="black", linestyle=style)
    ax.set_xlabel(f"{metric}: {b} - {a}")
    ax.set_ylabel("bootstrap resamples")
    ax.set_title(f"{boot['confidence']:.0%} interval [{boot['low']:+.3f}, {boot['high']:+.3f}]")
    return _png(fig)


def markdown_image(png: bytes, alt: str) -> str:
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"


def line_chart_png(xs: list[str], series: dict[str, list[float | None]], title: str) -> bytes:
    """One small panel per series over the same x (nights): figures of different scales side by side."""
    fig, axes = plt.subplots(len(series), 1, figsize=(6, 1.6 * len(series) + 0.6), sharex=True, squeeze=False)
    for ax, (name, values) in zip(axes[:, 0], series.items()):
        points = [(i, v) for i, v in enumerate(values) if v is not None]
        ax.plot([i for i, _ in points], [v for _, v in points], "o-")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xticks(range(len(xs)), xs, rotation=30, ha="right")
    axes[0, 0].set_title(title)
    return _png(fig)
