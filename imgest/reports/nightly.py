"""Markdown of a nightly run: a row per model (ingest and index), retirements, duplicates."""

from __future__ import annotations

from imgest.tasks.duplicates.report import describe_threshold


def render_nightly(runs: list[dict], retired: list, left_out: list[str] = (), duplicates: dict | None = None,
                   synced: list[dict] = ()) -> str:
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
                      f"{duplicates['near_groups']} near, **{duplicates['new_groups']} new** since the last report "
                      f"(`{duplicates['key']}`); {describe_threshold(duplicates)}."]
    for sync in synced:  # imgest nightly --sync-to: one line per target and model (two during a window)
        lines.append(f"\nSync to `{sync['target']}` failed: {sync['error']}" if "error" in sync else
                     f"\nSynced `{sync['target']}` with `{sync['model']}` into `{sync.get('collection', '?')}`"
                     f"{' (the name answers for it)' if sync.get('answers') else ''}: {sync['upserted']} upserted, "
                     f"{sync['deleted']} deleted, {sync['live']} live (`{sync['watermark']['key']}`)")
    return "\n".join(lines)
