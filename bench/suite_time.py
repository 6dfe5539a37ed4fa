"""Where the test suite's time goes: a JUnit XML report of a run (`pytest --junitxml=FILE`) summed by test file,
and by the lane each test belongs to (its `slow` causes, which tests/conftest.py records as the property
`causes`); given a second report, the two side by side. The figures are test-seconds (set-up, call and teardown
of each test): under `-n 2` they add up to about twice the wall time.

    .venv/bin/python -m pytest -q -n 2 --junitxml=after.xml
    .venv/bin/python bench/suite_time.py after.xml [--before before.xml] [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET  # noqa: N817 - a report pytest wrote on this machine, not untrusted input


def read(path: str) -> dict[str, tuple[float, str]]:
    """test id -> (seconds, causes) for every test case of the report."""
    cases = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        causes = next((p.get("value", "") for p in case.iter("property") if p.get("name") == "causes"), "")
        cases[f"{module}::{case.get('name')}"] = (float(case.get("time") or 0.0), causes)
    return cases


def by(cases: dict[str, tuple[float, str]], key) -> dict[str, tuple[int, float]]:
    out: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for test_id, (seconds, causes) in cases.items():
        out[key(test_id, causes)][0] += 1
        out[key(test_id, causes)][1] += seconds
    return {k: (n, s) for k, (n, s) in out.items()}


def table(title: str, after: dict, before: dict | None, top: int) -> str:
    rows = sorted(after.items(), key=lambda kv: -kv[1][1])
    head = f"| {title} | tests | test-minutes |" + (" before: tests | before: test-minutes |" if before else "")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    shown = rows[:top]
    for name, (n, s) in shown:
        line = f"| {name} | {n} | {s / 60:.1f} |"
        if before is not None:
            b = before.get(name)
            line += f" {b[0]} | {b[1] / 60:.1f} |" if b else " - | - |"
        lines.append(line)
    if len(rows) > top:
        rest = rows[top:]
        line = f"| {len(rest)} more | {sum(n for _, (n, _) in rest)} | {sum(s for _, (_, s) in rest) / 60:.1f} |"
        lines.append(line + (" | |" if before is not None else ""))
    total_n, total_s = sum(n for n, _ in after.values()), sum(s for _, s in after.values())
    line = f"| **all** | {total_n} | {total_s / 60:.1f} |"
    if before is not None:
        line += f" {sum(n for n, _ in before.values())} | {sum(s for _, s in before.values()) / 60:.1f} |"
    return "\n".join([*lines, line])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="JUnit XML of the run to describe")
    parser.add_argument("--before", help="JUnit XML of an earlier run, shown beside it")
    parser.add_argument("--top", type=int, default=25, help="files shown before the rest are summed")
    args = parser.parse_args()
    after = read(args.report)
    before = read(args.before) if args.before else None
    causes = {test_id: c for test_id, (_, c) in after.items()}

    def file_of(test_id: str, _causes: str) -> str:
        return test_id.split("::")[0]

    def lane_of(test_id: str, cause: str) -> str:  # a before-run's test takes the causes this run recorded
        if test_id not in causes:
            return cause or "not in this run"
        return causes[test_id] or "fast lane"

    print(table("file", by(after, file_of), by(before, file_of) if before else None, args.top))
    print()
    print(table("why it is slow (tests/conftest.py)", by(after, lane_of), by(before, lane_of) if before else None,
                args.top))


if __name__ == "__main__":
    main()
