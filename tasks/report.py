"""Render run summaries as markdown for people (Prefect artifacts, CLI) and keep JSON for scripts."""

from __future__ import annotations

from tasks.commit import RunSummary

COUNTS = ("listed", "new", "changed", "unchanged", "deleted", "rejected", "skipped", "encoded", "vanished")


def render_summary(summary: RunSummary, max_rejects: int = 20) -> str:
    lines = [
        f"## imgest ingest `{summary.run_id}`",
        "",
        f"- model: `{summary.model_id}` (namespace `model={summary.slug}`)",
        f"- catalogue: `{summary.catalogue}`",
        f"- store: `{summary.store}`",
        f"- device: `{summary.device}`, batch size **{summary.batch_size}** ({summary.batch_size_source})",
        f"- throughput: **{summary.images_per_second} images/s** over {summary.shards} shard(s), "
        f"{summary.encode_seconds} s encoding, {summary.seconds} s total",
        f"- snapshot: {summary.snapshot_seq}" + (f", {summary.resumed_shards} shard(s) resumed from an "
                                                 "interrupted run" if summary.resumed_shards else ""),
        "",
        "| " + " | ".join(COUNTS) + " |",
        "|" + "---:|" * len(COUNTS),
        "| " + " | ".join(str(getattr(summary, c)) for c in COUNTS) + " |",
    ]
    if summary.rejected_items:
        lines += ["", "### Rejected", "", "| item | reason |", "|---|---|"]
        for item_id, reason in summary.rejected_items[:max_rejects]:
            lines.append(f"| `{item_id}` | {reason.replace('|', '/')} |")
        if len(summary.rejected_items) > max_rejects:
            lines.append(f"| ... | {len(summary.rejected_items) - max_rejects} more in `imgest status` |")
    return "\n".join(lines) + "\n"
