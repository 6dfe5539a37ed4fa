"""Render run summaries as markdown for people (Prefect artifacts, CLI) and keep JSON for scripts."""

from __future__ import annotations

from tasks.commit import RunSummary
from tasks.plan import Plan
from tasks.shards import ShardResult

COUNTS = ("listed", "new", "changed", "unchanged", "deleted", "rejected", "skipped", "encoded", "vanished")


def render_summary(summary: RunSummary, max_rejects: int = 20) -> str:
    lines = [
        f"## imgest ingest `{summary.run_id}`",
        "",
        f"- model: `{summary.model_id}` (namespace `model={summary.slug}`)",
        f"- catalogue: `{summary.catalogue}`",
        f"- store: `{summary.store}`",
        f"- device: `{summary.device}`, batch size **{summary.batch_size}** ({summary.batch_size_source})",
        f"- throughput: **{summary.images_per_second} images/s** over {summary.shards} shard(s) on "
        f"{max(len(summary.workers), 1)} worker process(es), "
        f"{summary.encode_seconds} s encoding, {summary.seconds} s total",
        f"- projected: {summary.projected_full_encode_hours} h to encode all {summary.listed} listed images at this "
        f"rate; {summary.gpu_hours} GPU-hours used",
        *([f"- derived: {summary.derived} of the encoded came from stored base embeddings through the head "
           "(no image decoded)"] if summary.derived else []),
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


def progress_line(done: list[ShardResult], plan: Plan) -> str:
    """'3/10 shards, 6,000/20,000 images, 31.2 img/s, about 7.5 min left' for the progress artifact."""
    images = sum(len(s.items) for s in plan.shards[:len(done)])
    seconds = sum(r.seconds for r in done)
    rate = images / seconds if seconds else 0.0
    left = (plan.to_read - images) / rate if rate else float("nan")
    return (f"{len(done)}/{len(plan.shards)} shards, {images:,}/{plan.to_read:,} images, {rate:.1f} img/s, "
            f"about {left / 60:.1f} min left")


def render_reencode(summary: dict) -> str:
    """Throughput, elapsed and projected time and GPU-hours of a re-encode, for the operator's budget."""
    total = summary["listed"]
    done_before = summary["unchanged"]
    return "\n".join([
        f"## Re-encode with `{summary['model_id']}`",
        "",
        "| measure | value |",
        "|---|---:|",
        f"| catalogue images | {total} |",
        f"| encoded this run | {summary['encoded']} |",
        f"| already encoded (resumed or unchanged) | {done_before} |",
        f"| shards resumed from an interrupted run | {summary['resumed_shards']} |",
        f"| rejected | {summary['rejected']} |",
        f"| images/s | {summary['images_per_second']} |",
        f"| elapsed (s) | {summary['seconds']} |",
        f"| projected full re-encode (h) | {summary['projected_full_encode_hours']} |",
        f"| GPU-hours used | {summary['gpu_hours']} |",
        f"| device, batch size | {summary['device']}, {summary['batch_size']} |",
    ]) + "\n"


def render_window(status: dict) -> str:
    if not status.get("open"):
        return "No migration window is open.\n"
    w, cov = status["window"], status["coverage"]
    idx = status["index"]
    lines = [
        f"## Migration window `{w['id']}`: {w['from']['name']} -> {w['to']['name']} ({w['status']})",
        "",
        f"- opened by {w['opened_by']} at {w['opened_at']}; catalogue `{w['catalogue']}`",
        f"- coverage: {cov['covered']}/{cov['live']} live items ({cov['share']:.2%})",
        "- aliases: " + ", ".join(f"{n} -> {a['slug']} v{a['version']}" for n, a in sorted(status["aliases"].items())),
        f"- evaluation: {status['evaluation'] or 'none recorded yet'}",
        "",
        "| side | model | index version | current | storage MiB |",
        "|---|---|---:|---|---:|",
    ]
    for side in ("from", "to"):
        lines.append(f"| {side} | `{w[side]['slug']}` | {idx[side]['version']} | {idx[side]['current']} | "
                     f"{status['storage'][side]['total'] / 2**20:.1f} |")
    return "\n".join(lines) + "\n"
