"""Markdown of a trained head: its data, validation (a proxy called one), the scored query set."""

from __future__ import annotations


def render_head(summary: dict) -> str:
    c, v = summary["config"], summary["config"]["validation"]
    return "\n".join([
        f"## Head `{summary['head_id']}` ({c['loss']}) on `{c['base_model_id']}`",
        "",
        f"- model name: `{summary['head']}`",
        f"- {c['counts']['train_items']} training and {c['counts']['val_items']} held-out items, "
        + (f"{c['counts']['labels']} labels; {summary['unlabelled_live_items']} live items had no label"
         if c["labels"]["file"] else f"no labels: {c['labels']['items']} catalogue items as instances, "
         f"{c['labels']['augmented_views']} augmented views each ({c['labels']['transforms']})"),
        f"- validation measured on {v.get('measured_on', 'the held-out split')}"
        + (" (**a proxy**)" if v.get("proxy") else "") + f"; epochs selected on {v.get('selected_on', 'it')}",
        f"- held-out recall@1: **{v['recall@1']}** with the head vs {v['base_recall@1']} with the base model "
        f"(best epoch {v['best_epoch']} of {max(h['epoch'] for h in v['history'])}"
        + ("; epoch 0 is the untrained head, the base itself" if c.get("head_type") == "residual" else "")
        + f"); trained in {c['seconds']} s",
        *_head_eval_lines(v.get("eval")),
        f"- note: {v['note']}" if v.get("note") else "",
        f"- held-out query set for `imgest eval`: `{summary['queries']}`",
        "",
    ])


def _head_eval_lines(e: dict | None) -> list[str]:
    if not e:
        return []
    lines = [f"- on `{e['file']}` ({e['queries']} queries; {e['dropped_queries']} dropped, no live relevant item):",
             "", "| metric | base | head | head - base (95% paired bootstrap) |", "|---|---:|---:|---|"]
    for metric, b in e["bootstrap"].items():
        lines.append(f"| {metric} | {e['base'][metric]} | {e['head'][metric]} | {b['difference']:+.4f} "
                     f"[{b['low']:+.4f}, {b['high']:+.4f}] |")
    return lines + [""]


def render_whitening(saved: dict) -> str:
    c = saved["config"]
    how = (f"whitened by what {c['pairs']:,} (image, augmented view) pairs differ by ({c['views']} views of each "
           f"of {c['pair_images']:,} images: {', '.join(c['augmentations'])}), then rotated onto the "
           "catalogue's principal directions" if c.get("method") == "pairs"
           else "whitened by the live vectors' own covariance")
    lines = [
        f"## Whitening `{saved['head_id']}` on `{c['base_model_id']}`",
        "",
        f"- model name: `{saved['head']}` (use it like any model: `imgest migrate start --to` it)",
        f"- {how}",
        f"- {c['dim_in']} -> {c['dim_out']} dimensions, keeping {c['explained_variance']:.1%} of the variance; "
        f"eigenvalue shrinkage {c['shrinkage']:g} ({c['shrinkage_source']})",
        f"- fitted on {c['sample']:,} of {c['live_items']:,} live vectors (seed {c['seed']}), no labels; "
        f"weights sha256 `{c['weights_sha256'][:16]}...`",
    ]
    proxy = c.get("proxy") or {}
    if proxy.get("held_out_items"):
        lines.append(f"- proxy (augmented views of {proxy['held_out_items']:,} held-out images, each searched among "
                     f"{proxy['searched']:,} live vectors; not a measure of real queries): recall@1 "
                     f"{proxy['base']:.3f} base, {proxy['whitened']:.3f} whitened. Measure real queries with "
                     "`imgest eval` before promoting.")
    return "\n".join(lines + [""])
