"""A person watching a long command sees its progress: a live bar on a terminal, plain lines elsewhere."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys

import pytest

from imgest.progress import report, reporting
from tests.helpers import gradient, png_bytes, write_files


def test_plain_lines_when_not_a_terminal(monkeypatch):
    """In a log: each count's first and last line, and one every 10 s between, never a line per update."""
    from imgest import progress

    clock = iter([0.0, 1.0, 5.0, 10.5, 12.0, 13.0, 14.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    with reporting(out):
        for done in (0, 1000, 2000, 3000, 4000):  # at 0, 1, 5, 10.5 and 12 s
            report("model-a", done, 6000)
        report("model-b", 10, 20, "vectors")  # another count has its own first line
        report("model-a", 6000, 6000)  # the last, whenever it comes
    report("model-a", 6000, 6000)  # outside: nobody is watching, nothing is printed
    lines = out.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == ["model-a: 0/6", "model-a: 3", "model-b: 10/20 vectors",
                                                      "model-a: 6"], lines
    assert lines[1].startswith("model-a: 3,000/6,000 images") and lines[3].startswith("model-a: 6,000/6,000")


@pytest.mark.usefixtures("prefect_harness")  # the CLI runs report to the session's server
def test_ingest_on_a_terminal_draws_a_bar_and_plain_lines_in_a_pipe(tmp_path):
    cat, store = tmp_path / "cat", tmp_path / "store"
    write_files(str(cat), {f"p/{i:02d}.png": png_bytes(gradient(i, (32, 32))) for i in range(12)})
    imgest = os.path.join(os.path.dirname(sys.executable), "imgest")
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "COLUMNS": "160"}
    from prefect.settings import PREFECT_API_URL

    env["PREFECT_API_URL"] = PREFECT_API_URL.value()  # the session's server: no ephemeral one to start
    args = [imgest, "ingest", "--catalogue", str(cat), "--store", str(store), "--model", "raw-pixels",
            "--shard-size", "4", "--batch-size", "4"]
    piped = subprocess.run(args, capture_output=True, text=True, timeout=240, env=env)
    assert piped.returncode == 0, piped.stderr[-2000:]
    assert "12/12 images" in piped.stderr and "img/s" in piped.stderr

    write_files(str(cat), {f"p/{i:02d}.png": png_bytes(gradient(100 + i, (32, 32))) for i in range(12, 20)})
    parent, child = pty.openpty()  # a real terminal for the command's stderr
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=child, env=env)
    os.close(child)
    captured = b""
    while True:
        try:
            chunk = os.read(parent, 65536)
        except OSError:  # the terminal closed with the process
            break
        if not chunk:
            break
        captured += chunk
    assert proc.wait(timeout=240) == 0
    text = captured.decode(errors="replace")
    assert "8/8" in text and "images" in text and "━" in text, text[-2000:]  # rich's bar

    built = subprocess.run([imgest, "build-index", "--store", str(store), "--model", "raw-pixels"],
                           capture_output=True, text=True, timeout=240, env=env)
    assert built.returncode == 0, built.stderr[-2000:]
    assert "raw-pixels" in built.stderr and "20/20 vectors" in built.stderr and "vectors/s" in built.stderr


def test_vectors_are_counted_as_vectors():
    out = io.StringIO()
    with reporting(out):
        report("m index", 65536, 100000, "vectors")
    assert out.getvalue().startswith("m index: 65,536/100,000 vectors, ") and "vectors/s" in out.getvalue()
