"""A newcomer's first hour, from the installed package: `imgest demo`, then the commands it prints, each run as
printed, then its search page in headless Chromium (a text query, a filter, an image drop, a fused "more like
this", a refused query), with a screenshot kept under test-artifacts/."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import shutil
import socket
import subprocess
import time

import httpx
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
HIT = re.compile(r"^\s+(\d+)\s+(-?\d+\.\d+)\s+(\S+)")


def _hits(output: str) -> list[str]:
    return [m.group(3) for line in output.splitlines() if (m := HIT.match(line))]


def _next_commands(output: str) -> list[str]:
    lines = output.split("Next, try:\n", 1)[1].splitlines()
    return [line.split("    #", 1)[0].strip() for line in lines if line.startswith("  ")]


@pytest.mark.slow("a subprocess")
def test_the_demo_finds_things_as_printed_and_on_its_page(installed_imgest, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PREFECT_API_URL", "IMGEST_MODEL_DIRS")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    demo = subprocess.run([installed_imgest["imgest"], "demo", "--workdir", "demo", "--per-class", "10"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "index `model=efficientnet-lite0-" in demo.stdout.replace("## Index ", "index ")
    assert _hits(demo.stdout.split("$ imgest search", 1)[1])[0] == "photos/chelsea.jpg"  # the query finds itself
    store = tmp_path / "demo" / "store"
    assert (store / "aliases" / "serving.json").exists() and (store / "aliases" / "captions.json").exists()

    commands = _next_commands(demo.stdout)
    assert [shlex.split(c)[1] for c in commands] == ["api", "search", "search", "search", "migrate"], commands
    assert all(shlex.split(c)[0] == installed_imgest["imgest"] for c in commands), "runnable as printed"
    ran = {}
    for command in commands[1:]:  # the service is the page's part, below
        done = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
        ran[command] = done.stdout
    by_title, filtered, fused, migrated = ran.values()
    # Lite0 has no text tower: the caption retriever answers the text, and says so
    assert "serving has no text tower: the caption retriever (captions) answers" in by_title
    top = _hits(by_title)
    assert len(top) == 10 and sum(item.startswith("fashion/ankle-boot/") for item in top) >= 8, top
    assert _hits(filtered) and all(item.startswith("fashion/sneaker/") for item in _hits(filtered)), filtered
    assert "reciprocal rank fusion" in fused and len(_hits(fused)) == 10
    assert (store / "aliases" / "shadow.json").exists(), migrated  # the window is open beside serving
    # the window says how to get the evaluation promote needs, as commands that run as printed
    imgest = shlex.quote(installed_imgest["imgest"])
    status = subprocess.run(f"{imgest} migrate status --store demo/store", shell=True, cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    hint = status.stdout.split("- evaluation: none recorded yet", 1)[1].splitlines()[0]
    for command in re.findall(r"`(imgest [^`]+)`", hint):
        done = subprocess.run(f"{imgest} {command.removeprefix('imgest ')}", shell=True, cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (command, done.stderr[-2000:])
    status = subprocess.run(f"{imgest} migrate status --store demo/store --json", shell=True, cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=120)
    assert '"metric": "recall@10"' in status.stdout, status.stdout[-2000:]

    _page(installed_imgest["imgest"], env, tmp_path)


def _page(imgest: str, env: dict, cwd: pathlib.Path) -> None:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    assert chromium, "Chromium is missing: infra/setup.sh installs Debian's chromium for this check"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    service = subprocess.Popen([imgest, "api", "--store", "demo/store", "--port", str(port)], cwd=cwd, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, cards = f"http://127.0.0.1:{port}", "#results article.hit"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                assert service.poll() is None, service.stdout.read()[-3000:]
            time.sleep(0.5)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 1000})
                page.goto(url + "/", wait_until="domcontentloaded")
                page.wait_for_function("() => document.querySelector('#status').textContent === 'ready'")
                options = page.locator("#alias option").all_inner_texts()
                assert [o.split(" ")[0] for o in options] == ["serving", "captions", "all,"], options
                filters = page.locator("[data-column]").evaluate_all("fs => fs.map(f => f.dataset.column)")
                assert filters == ["title", "category"], "only the columns the catalogue fills are offered"

                def shown() -> list[str]:
                    return page.locator(cards).evaluate_all("cs => cs.map(c => c.dataset.item)")

                page.locator("#text").fill("ankle boot")
                page.locator("#go").click()
                page.wait_for_function("() => document.querySelector('#status').textContent.includes('results')")
                assert "no text tower" in page.locator("#status").inner_text()
                assert sum(i.startswith("fashion/ankle-boot/") for i in shown()[:10]) >= 8, shown()
                first = page.locator(cards).first.inner_text()
                assert re.search(r"0\.\d{4} · captions · minilm-l6", first) and "ankle boot" in first, first
                page.wait_for_function(f"() => [...document.querySelectorAll('{cards} img')]"
                                       ".every(i => i.complete && i.naturalWidth > 0)", timeout=30_000)

                page.locator("select[data-column='category']").select_option("sneaker")  # a filter
                page.locator("#text").fill("shoes")
                page.locator("#go").click()
                page.wait_for_function(f"() => [...document.querySelectorAll('{cards}')]"
                                       ".every(c => c.dataset.item.startsWith('fashion/sneaker/'))")
                assert len(shown()) == 10, shown()  # every sneaker of the demo, and nothing else

                page.locator("select[data-column='category']").select_option("")
                page.locator("#file").set_input_files(str(cwd / "demo" / "catalogue" / "photos" / "chelsea.jpg"))
                page.wait_for_function(f"() => document.querySelector('{cards}')?.dataset.item === "
                                       "'photos/chelsea.jpg'")
                page.locator("#alias").select_option("*rrf")  # captions and images fused: one click
                page.locator(f"{cards} button").nth(1).click()
                page.wait_for_function("() => document.querySelector('#status').textContent.includes('more like')")
                assert "captions" in page.locator(cards).first.inner_text() or \
                    "serving" in page.locator(cards).first.inner_text()
                ARTIFACTS.mkdir(exist_ok=True)
                page.screenshot(path=str(ARTIFACTS / "demo-page.png"), full_page=True)

                page.locator("#where").fill("no_such_column = 1")  # refused: its reason, and no stale results
                page.locator("#go").click()
                page.wait_for_function("() => document.querySelector('#status').className === 'error'")
                assert "no_such_column" in page.locator("#status").inner_text()
                assert shown() == []
            finally:
                browser.close()
    finally:
        service.terminate()
        service.wait(timeout=30)
