"""Markdown for people (Prefect artifacts, the CLI): run summaries, index cards, nightly, window, eval, head, cost."""

from __future__ import annotations

from imgest.tasks.commit import RunSummary
from imgest.tasks.plan import Plan
from imgest.tasks.shards import ShardResult

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


def _metadata_line(m: dict) -> str:
    stored = f"stored as snapshot {m['snapshot_seq']}" if m["written"] else f"unchanged (snapshot {m['snapshot_seq']})"
    examples = (m.get("unknown_examples") or [])[:3]
    shown = f" (e.g. {', '.join(f'`{e}`' for e in examples)})" if examples else ""
    return (f"- metadata `{m['source']}`: {m['rows']} rows, {m['new']} new, {m['changed']} changed, {m['removed']} "
            f"removed; {stored}; {m['unknown_items']} row(s) for items the catalogue does not list{shown}, "
            f"{m['without_row']} listed image(s) without a row")


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


def _evaluation_line(e: dict | None) -> str:
    if not e:
        return "none recorded yet (promote needs one: `imgest eval --alias serving --compare shadow`)"
    interval = e.get("interval", {})
    span = f", {interval['of']} in [{interval['low']}, {interval['high']}]" if "low" in interval else ""
    return (f"{e['metric']} shadow {e['shadow']} vs serving {e['serving']}{span} on {e.get('queries')} queries "
            f"of `{e.get('query_file')}` ({e.get('source', 'imgest eval')}, {e['at']})")


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
        f"- evaluation: {_evaluation_line(status['evaluation'])}",
        "",
        "| side | model | index version | current | storage MiB |",
        "|---|---|---:|---|---:|",
    ]
    for side in ("from", "to"):
        lines.append(f"| {side} | `{w[side]['slug']}` | {idx[side]['version']} | {idx[side]['current']} | "
                     f"{status['storage'][side]['total'] / 2**20:.1f} |")
    return "\n".join(lines) + "\n"


def render_card(card: dict) -> str:
    rec = card["recall"]
    served_recall = rec[f"recall@{rec['k']}"]
    verdict = "meets" if rec["met"] else "**DOES NOT MEET**"
    lines = [
        f"## Index `model={card['slug']}` v{card['version']:04d}",
        "",
        f"- model: `{card['model_id']}`; {card['n']} vectors of d={card['d']} from snapshot {card['snapshot']}",
        f"- index: `{card['factory']}` ({card['choice']['reason']}); memory budget {card['choice']['memory_budget']}",
        f"- served: {served_parameters(card)}; recall@{rec['k']} "
        f"{served_recall} on {rec['queries']} held-out queries, {verdict} the target {rec['target']}",
        f"- latency: {card['latency_ms_per_query']} ms/query (batched); {card['bytes_on_disk']} bytes on disk, "
        f"{card['bytes_on_disk'] / max(card['n'], 1):.1f} bytes/vector",
        f"- build: train {card['times']['train_seconds']} s, add {card['times']['add_seconds']} s, "
        f"total {card['times']['total_seconds']} s"
        + (f" ({card['build']['parts']} parts added in parallel on {card['build']['runner']}, merged)"
           if card.get("build", {}).get("parts", 1) > 1 else "")
        + f"; sha256 `{card['sha256'][:16]}...`",
    ]
    if card.get("lineage"):
        lines.append(f"- lineage: {render_lineage(card['lineage'])}")
    if card["search"].get("k_factor") is not None:  # PQ candidates re-ranked: both parameters in the sweep
        foot = card["footprint"]
        lines += [f"- re-rank: {card['search']['k_factor']} x k candidates from the PQ codes, re-scored by float16 "
                  f"vectors (in {foot['refine']}); RAM {foot['ram_bytes']:,} bytes, disk {foot['disk_bytes']:,} bytes",
                  "", f"| {card['search']['param']} | k_factor | recall@{rec['k']} | ms/query |",
                  "|---:|---:|---:|---:|"]
        lines += [f"| {p['param']} | {p['k_factor']} | {p['recall']} | {p['ms_per_query']} |" for p in rec["sweep"]]
        return "\n".join(lines) + "\n"
    lines += ["", f"| {card['search']['param'] or 'exact'} | recall@{rec['k']} | ms/query |", "|---:|---:|---:|"]
    lines += [f"| {p['param']} | {p['recall']} | {p['ms_per_query']} |" for p in rec["sweep"]]
    return "\n".join(lines) + "\n"


def render_lineage(line: dict) -> str:
    if line["method"] == "update":
        return (f"updated from v{line['updated_from']:04d} (-{line['removed']:,} +{line['added']:,}); trained in "
                f"v{line['trained_in']:04d} on {line['trained_n']:,} vectors, {line['added_since_training']:,} added "
                f"since (retrains past {line['retrain_share']:.0%})")
    return f"trained in this version on {line['trained_n']:,} vectors ({line['why']})"


def served_parameters(card: dict) -> str:
    search = card["search"]
    refine = f", k_factor={search['k_factor']}" if search.get("k_factor") is not None else ""
    return f"{search['param']}={search['value']}{refine}" if search["param"] else "exact search"


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


def render_cost(report: dict) -> str:
    gib = 2 ** 30
    lines = [f"## Cost of `{report['model_id']}` at {report['corpus_size']:,} items ({report['device']})", "",
             "| batch | img/s |", "|---:|---:|"]
    lines += [f"| {b} | {r} |" for b, r in report["encode_images_per_second"].items()]
    rc = report["reencode_cost"]
    price = f", {rc['price']} at {rc['gpu_hour_price']}/GPU-hour" if rc["price"] is not None else ""
    lines += ["",
              f"- full encode / re-encode per model change: **{report['projected_encode_hours']} "
              f"{rc['device']}-hours** at batch {report['best_batch']}{price}",
              f"- query encode: image {report['query_encode_ms']['image']} ms, text "
              f"{report['query_encode_ms']['text'] if report['query_encode_ms']['text'] is not None else 'n/a'} ms",
              "- storage: " + ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in report["storage_bytes"].items()),
              f"- index: `{report['index']['factory']}` about {report['index']['estimated_bytes'] / gib:.2f} GiB in RAM"
              + (f" and {report['index']['disk_bytes'] / gib:.2f} GiB of re-rank vectors on disk"
                 if report["index"].get("disk_bytes") else "")
              + f"; fits {report['index']['node_memory']}: {report['index']['fits']}"]
    if report["dual_window_fp32_bytes"]:
        lines.append(f"- migration window (both models at fp32): {report['dual_window_fp32_bytes'] / gib:.2f} GiB")
    return "\n".join(lines) + "\n"


def render_nightly(runs: list[dict], retired: list, left_out: list[str] = (), duplicates: dict | None = None) -> str:
    lines = ["# imgest nightly", "", "| model | listed | encoded | rejected | deleted | images/s | index | recall@k "
             "| aliases |", "|---|---:|---:|---:|---:|---:|---|---:|---|"]
    for run in runs:
        s, index = run["ingest"], run["index"]
        if index.get("built"):
            card = index["card"]
            built = f"v{card['version']:04d} `{card['factory']}`"
            rec = card["recall"]
            recall = f"{rec['recall@' + str(rec['k'])]:.3f}"
        else:
            built, recall = index.get("reason", "not built"), "-"
        lines.append(f"| `{s['model_id']}` | {s['listed']} | {s['encoded']} | {s['rejected']} | {s['deleted']} | "
                     f"{s['images_per_second']} | {built} | {recall} | {', '.join(index.get('aliases', [])) or '-'} |")
    if retired:
        lines += ["", f"Retired: {', '.join(map(str, retired))}"]
    lines += [f"\nLeft out: {line}" for line in left_out]
    if duplicates:
        lines += ["", f"Duplicates of `{duplicates['model_id']}`: {duplicates['exact_groups']} exact groups, "
                      f"{duplicates['near_groups']} near (cosine >= {duplicates['threshold']}), "
                      f"**{duplicates['new_groups']} new** since the last report (`{duplicates['key']}`)."]
    return "\n".join(lines)


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


def render_finished(finished: dict) -> str:
    return (f"Window {finished['window']['id']} finished; deleted now: "
            f"{finished['deleted'] or 'nothing (retention or aliases hold it)'}\n")
