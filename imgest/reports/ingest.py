"""Markdown of an ingest run: its summary, the progress line, a re-encode's budget."""

from __future__ import annotations

from imgest.tasks.ingest.commit import RunSummary
from imgest.tasks.ingest.plan import Plan
from imgest.tasks.ingest.writer import ShardResult

COUNTS = ("listed", "new", "changed", "unchanged", "deleted", "rejected", "skipped", "encoded", "vanished", "failed",
          "revived")


def render_summary(summary: RunSummary, max_rejects: int = 20) -> str:
    lines = [
        f"## imgest ingest `{summary.run_id}`",
        "",
        f"- model: `{summary.model_id}` (namespace `model={summary.slug}`)",
        f"- catalogue: `{summary.catalogue}`",
        f"- store: `{summary.store}`",
        f"- device: `{summary.device}`, batch size **{summary.batch_size}** ({summary.batch_size_source})",
        *([f"- **{summary.device_note}**"] if summary.device_note else []),
        *([_encoding_line(summary)] if summary.runtime else []),
        f"- throughput: **{summary.images_per_second} images/s** over {summary.shards} shard(s) on "
        f"{max(len(summary.workers), 1)} worker process(es), "
        f"{summary.encode_seconds} s encoding, {summary.seconds} s total",
        f"- projected: {summary.projected_full_encode_hours} h to encode all {summary.listed} listed images at this "
        f"rate; {summary.gpu_hours} GPU-hours used",
        *([f"- derived: {summary.derived} of the encoded came from stored base embeddings through the head "
           "(no image decoded)"] if summary.derived else []),
        *([f"- failed: {summary.failed} object(s) for a transient reason (timeout, throttling, memory): read "
           "again on the next run"] if summary.failed else []),
        *([f"- not regular files (FIFOs, devices, dangling links): {summary.not_regular} skipped, never read"]
          if summary.not_regular else []),
        f"- snapshot: {summary.snapshot_seq}" + (f", {summary.resumed_shards} shard(s) resumed from an "
                                                 "interrupted run" if summary.resumed_shards else ""),
        *([_metadata_line(summary.metadata)] if summary.metadata else []),
        *([f"- text read: metadata snapshot {summary.texts['metadata_snapshot']}; "
           f"{summary.texts['images_without_text']} listed image(s) without text, "
           f"{summary.texts['rows_for_unlisted_items']} row(s) with text for items the catalogue does not list, "
           f"{summary.texts['rows_without_text']} row(s) without text"] if summary.texts else []),
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


def _encoding_line(summary: RunSummary) -> str:
    line = f"- runtime: **{summary.runtime} {summary.precision}**"
    encoding = summary.encoding or {}
    if encoding.get("parity") is not None:
        line += f", min cosine {encoding['parity']} against torch fp32 on the parity sample"
    if encoding.get("measured"):
        at = f" at batch {encoding['measured_at']}" if encoding.get("measured_at") else ""
        line += f"; measured img/s{at}: " + ", ".join(f"{k} {v}" for k, v in sorted(encoding["measured"].items()))
    if encoding.get("refused"):
        line += "; not used: " + "; ".join(r.replace("|", "/") for r in encoding["refused"])
    if encoding.get("decode_seconds") and encoding.get("encode_seconds") and summary.work_bound:
        line += (f"; decode {encoding['decode_seconds'] * 1e3:.1f} and encode {encoding['encode_seconds'] * 1e3:.1f} "
                 f"core-ms a picture: work bound {summary.work_bound} img/s")
    if encoding.get("decoders") or encoding.get("decoder_source"):
        line += f"; JPEGs decoded by {encoding.get('decoder', 'pillow')}"
        if encoding.get("decode_side"):
            line += f" down to {encoding['decode_side']} px"
        if encoding.get("decoder_source"):
            line += f", {encoding['decoder_source'].replace('|', '/')}"
        if encoding.get("decoders"):
            line += " (core-ms a picture: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in encoding["decoders"].items()) \
                + ")"
    if encoding.get("warning"):
        line += f"; **{encoding['warning'].replace('|', '/')}**"
    return line


def _metadata_line(m: dict) -> str:
    stored = f"stored as snapshot {m['snapshot_seq']}" if m["written"] else f"unchanged (snapshot {m['snapshot_seq']})"
    examples = (m.get("unknown_examples") or [])[:3]
    shown = f" (e.g. {', '.join(f'`{e}`' for e in examples)})" if examples else ""
    return (f"- metadata `{m['source']}`: {m['rows']} rows, {m['new']} new, {m['changed']} changed, {m['removed']} "
            f"removed; {stored}; {m['unknown_items']} row(s) for items the catalogue does not list{shown}, "
            f"{m['without_row']} listed image(s) without a row")


def progress_line(done: list[ShardResult], plan: Plan) -> str:
    """'3/10 shards, 6,000/20,000 images, 31.2 img/s, about 7.5 min left' for the progress artifact."""
    images = int(plan.counts()[:len(done)].sum())
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
