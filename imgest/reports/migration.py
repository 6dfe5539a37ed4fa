"""Markdown of a migration window: its state, coverage, evaluation, shadow traffic; a finished window."""

from __future__ import annotations

from imgest.reports.index import render_encoded_by


def _evaluation_line(e: dict | None, window: dict, store: str | None) -> str:
    if not e:  # the whole way there, runnable as printed: a query set from the catalogue's folders, then eval
        return ("none recorded yet; promote needs one, e.g. `imgest queries class --catalogue "
                f"{window['catalogue']} --out queries.jsonl` (or your own labelled queries), then `imgest eval "
                f"--store {store or 'STORE'} --queries queries.jsonl --alias serving --compare shadow`")
    interval = e.get("interval", {})
    span = f", {interval['of']} in [{_num(interval['low'])}, {_num(interval['high'])}]" if "low" in interval else ""
    return (f"{e['metric']} shadow {_num(e['shadow'])} vs serving {_num(e['serving'])}{span} on {e.get('queries')} "
            f"queries of `{e.get('query_file')}` ({e.get('source', 'imgest eval')}, {e['at']})")


def _num(value) -> str:
    return f"{value:+.4f}".lstrip("+") if isinstance(value, float) else str(value)


def _shadow_line(s: dict | None) -> str:
    if not s or not s["queries"]:
        return "no shadow traffic recorded (serve with `imgest api --shadow-share F`)" + \
            (f"; {s['errors']} failed on shadow" if s and s["errors"] else "")
    latency = s["latency_ms"]
    return (f"mean overlap@k {s['mean_overlap']:.4f} over {s['queries']} live queries ({s['errors']} failed on "
            f"shadow); p50/p99 ms serving {latency['serving']['p50']}/{latency['serving']['p99']}, shadow "
            f"{latency['shadow']['p50']}/{latency['shadow']['p99']} ({s['first']} to {s['last']})")


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
        f"- evaluation: {_evaluation_line(status['evaluation'], w, status.get('store'))}",
        f"- shadow traffic: {_shadow_line(status.get('shadow'))}",
        "",
        "| side | model | index version | current | encoded by | storage MiB |",
        "|---|---|---:|---|---|---:|",
    ]
    for side in ("from", "to"):
        encoded = render_encoded_by(idx[side].get("encoded_by")) if idx[side]["version"] is not None else ""
        lines.append(f"| {side} | `{w[side]['slug']}` | {idx[side]['version']} | {idx[side]['current']} | "
                     f"{encoded} | {status['storage'][side]['total'] / 2**20:.1f} |")
    targets = status.get("targets") or {}
    for sync in targets.get("switched", []):  # promote/rollback --sync-to: one line per target
        lines.append(f"\nTarget `{sync['target']}`: " + (f"not switched: {sync['error']} (the next nightly switches "
                     "it)" if "error" in sync else f"answers for `{sync['model']}` (`{sync['collection']}`, "
                     f"{sync['upserted']} upserted, {sync['deleted']} deleted before the switch)"))
    if targets.get("not_switched"):
        lines.append(f"\nSynced from this store but not named with --sync-to, not switched now (the nightly that "
                     f"syncs them switches them): {', '.join(targets['not_switched'])}")
    return "\n".join(lines) + "\n"


def render_finished(finished: dict) -> str:
    done = " had already finished" if finished.get("already_finished") else " finished"
    return (f"Window {finished['window']['id']}{done}; deleted now: "
            f"{finished['deleted'] or 'nothing (retention or aliases hold it)'}\n")
