"""Markdown of an index: its card, its lineage, the served search parameters, the cost model."""

from __future__ import annotations

from imgest.retrieval.versions import served_parameters


def render_card(card: dict) -> str:
    rec = card["recall"]
    served_recall = rec[f"recall@{rec['k']}"]
    verdict = "meets" if rec["met"] else "**DOES NOT MEET**"
    lines = [
        f"## Index `model={card['slug']}` v{card['version']:04d}",
        "",
        f"- model: `{card['model_id']}`; {card['n']} vectors of d={card['d']} from snapshot {card['snapshot']}",
        f"- encoded by: {render_encoded_by(card.get('encoded_by'))}",
        f"- JPEGs decoded by: {render_encoded_by(card.get('decoded_by'))}",
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
    # a Flat index has no search parameter: its one row is the exact search itself
    lines += [f"| {'exact' if p['param'] is None else p['param']} | {p['recall']} | {p['ms_per_query']} |"
              for p in rec["sweep"]]
    return "\n".join(lines) + "\n"


def render_encoded_by(encoded_by) -> str:
    """A version's rows by what encoded them, the most first: "openvino fp32 90.0%, torch bf16 10.0%" (a few rows
    show as "<0.1%", never "0.0%", nor the rest as "100.0%"); or by the JPEG decoder that made them (the card's
    `decoded_by`). The card is read from a store: printable names with counts only."""
    counts = {k: v for k, v in (encoded_by or {}).items() if isinstance(k, str) and k.isprintable() and len(k) <= 120
              and isinstance(v, int) and not isinstance(v, bool) and v > 0} if isinstance(encoded_by, dict) else {}
    if not counts:
        return "not recorded (a version built before imgest counted it)"
    total = sum(counts.values())
    return ", ".join(f"{label} {_share(rows, total)}"
                     for label, rows in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _share(rows: int, total: int) -> str:
    share = 100 * rows / total
    return "<0.1%" if share < 0.05 else ">99.9%" if rows < total and share >= 99.95 else f"{share:.1f}%"


def render_lineage(line: dict) -> str:
    if line["method"] == "update":
        return (f"updated from v{line['updated_from']:04d} (-{line['removed']:,} +{line['added']:,}); trained in "
                f"v{line['trained_in']:04d} on {line['trained_n']:,} vectors, {line['added_since_training']:,} added "
                f"since (retrains past {line['retrain_share']:.0%})")
    return f"trained in this version on {line['trained_n']:,} vectors ({line['why']})"


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
    if change := report.get("model_change"):
        lines += ["", f"### A model change at {report['corpus_size']:,} items, from one rehearsed at "
                      f"{change['rehearsed_objects']:,} ({change['rehearsed_on'] or 'undated'}), times scaled "
                      "linearly", "", "| stage | rehearsed s | projected hours | peak RSS MB (rehearsed) |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {name} | {row['measured_seconds']} | {row['projected_hours']} | {row['peak_rss_mb']} |"
                  for name, row in change["stages"].items()]
        lines += ["", f"- to a model derived from stored vectors (a head): **{change['derived_model_hours']} "
                      "hours**", f"- to a new backbone (every image encoded as above): at most "
                      f"**{change['new_backbone_hours']} hours**"]
    if kept := report.get("kept_pixels"):
        lines += ["", f"### A new backbone's re-encode, from the catalogue and from kept pixels (side {kept['side']}, "
                      f"{kept['cores']} cores here)", "",
                  f"- per image: original {kept['original_bytes_per_image'] / 1024:,.0f} kB, copy "
                  f"{kept['copy_bytes_per_image'] / 1024:,.0f} kB"
                  + ("" if kept["copies_measured"] else " (estimated on the parity sample: the store keeps none)")
                  + "; decode core-ms " + ", ".join(f"{k} {v}" for k, v in kept["decode_core_ms_per_image"].items())
                  + ("" if kept["fits"] else "; this model's preprocessing needs more than the side: it reads "
                                              "the originals"), "",
                  "| items | hours (catalogue) | hours (kept pixels) | objects read (catalogue / kept) | "
                  "bytes read (catalogue / kept) | copies' storage |", "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {int(n):,} | {row['hours']['catalogue']} | {row['hours']['kept pixels']} | "
                  f"{row['objects_read']['catalogue']:,} / {row['objects_read']['kept pixels']:,} | "
                  f"{row['bytes_read']['catalogue'] / gib:,.1f} / {row['bytes_read']['kept pixels'] / gib:,.1f} GiB | "
                  f"{row['copies_storage_bytes'] / gib:,.1f} GiB |" for n, row in kept["at"].items()]
    return "\n".join(lines) + "\n"
