"""imgest api: real uvicorn on a free port over a real store; search parity with `imgest search`, an alias moved
under concurrent requests with none failing, bounded bad requests answered 4xx in one line, the bearer token."""

from __future__ import annotations

import base64
import json
import threading
import time

import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

from imgest.cli import app
from imgest.config import IndexConfig
from imgest.flows.build_index import build_index
from imgest.retrieval.combined import read_route
from imgest.retrieval.following import FollowingSearcher
from imgest.retrieval.items import ItemNotFound, StoredVectors
from imgest.retrieval.query import Searcher
from imgest.retrieval.versions import read_card
from imgest.state.aliases import set_alias
from imgest.storage import Location
from imgest.tasks.search.service import create_app
from tests.helpers import gradient, ingest_into, png_bytes, served_app, write_files

pytestmark = pytest.mark.usefixtures("prefect_harness")
MODEL, TOKEN = "raw-pixels", "test-token-not-a-secret"


@pytest.fixture()
def served(tmp_path):
    cat, store = tmp_path / "cat", tmp_path / "store"
    write_files(str(cat), {f"{i:03d}.png": png_bytes(gradient(i)) for i in range(30)})
    meta = tmp_path / "meta.csv"
    meta.write_text("item_id,title,price\n" + "".join(f"{i:03d}.png,gradient {i},{i}.5\n" for i in range(30)))
    ingest_into(cat, store, model=MODEL, batch_size="8", metadata=str(meta))
    for _ in range(2):
        build_index(IndexConfig(store=str(store), model=MODEL, alias="serving", rebuild=True))
    location = Location(str(store))
    slug = next(iter(location.list_names("indexes"))).removeprefix("model=")
    set_alias(location, "serving", read_card(location, slug, 1), "test: start on v1")
    set_alias(location, "shadow", read_card(location, slug, 2), "test: a second retriever")
    route = tmp_path / "route.json"
    route.write_text(json.dumps({"a": "serving", "b": "shadow", "classes": {"visual": "a", "mixed": "rrf"},
                                 "default": "b", "calibration": {"a": [1.0, 0.0], "b": [1.0, 0.0]}}))
    follower = FollowingSearcher(str(store), ("serving",), device="cpu", route=read_route(str(route)))
    follower.refresh()
    with served_app(create_app(follower, token=TOKEN)) as url:
        yield {"url": url, "follower": follower, "store": store, "cat": cat, "location": location, "slug": slug,
               "route": route}


def _auth() -> dict:
    return {"Authorization": f"Bearer {TOKEN}"}


def test_search_answers_as_the_command_does_and_bad_requests_get_one_line(served):
    url, image = served["url"], served["cat"] / "007.png"
    assert httpx.get(f"{url}/healthz").status_code == 200
    for method, route in (("GET", "/aliases"), ("GET", "/columns"), ("GET", "/thumbnail?item_id=007.png"),
                          ("GET", "/metrics"), ("POST", "/search")):  # every route with data needs the token
        for auth in ({}, {"Authorization": "Bearer wrong-token"}, {"Authorization": TOKEN}):
            refused = httpx.request(method, f"{url}{route}", headers=auth, json={"item_id": "007.png"})
            assert refused.status_code == 401, (route, auth, refused.text)
    aliases = httpx.get(f"{url}/aliases", headers=_auth()).json()
    assert aliases["serving"]["version"] == 1 and aliases["serving"]["model"] == served["slug"]

    body = {"image_b64": base64.b64encode(image.read_bytes()).decode(), "k": 5}
    answer = httpx.post(f"{url}/search", json=body, headers=_auth())
    assert answer.status_code == 200, answer.text
    hits = answer.json()["hits"]
    cli = CliRunner().invoke(app, ["search", "--store", str(served["store"]), "--image", str(image), "--k", "5",
                                   "--json", "--device", "cpu"])
    assert cli.exit_code == 0, cli.output
    expected = json.loads(cli.stdout)
    assert [h["item_id"] for h in hits] == [h["item_id"] for h in expected["results"][0]["hits"]]
    assert [h["score"] for h in hits] == pytest.approx([h["score"] for h in expected["results"][0]["hits"]], abs=1e-5)
    assert hits[0]["item_id"] == "007.png" and {(h["model"], h["version"], h["alias"]) for h in hits} == \
        {(served["slug"], 1, "serving")}
    assert hits[0]["metadata"]["title"] == "gradient 7" and hits[0]["metadata"]["price"] == 7.5
    # what encoded the query, in each hit and per alias: raw pixels run as they are (numpy), as at ingest
    assert {h["query_encoded_by"] for h in hits} == {"numpy fp32"} == {expected["query_encoded_by"]}
    assert httpx.get(f"{url}/aliases", headers=_auth()).json()["serving"]["query_encoded_by"] == "numpy fp32"
    filtered = httpx.post(f"{url}/search", json={**body, "where": "price < 3"}, headers=_auth()).json()["hits"]
    assert sorted(h["item_id"] for h in filtered) == ["000.png", "001.png", "002.png"]

    for bad, status, says in (
            ({"text": "red shoes"}, 400, "no text tower"),
            ({**body, "k": 0}, 422, "k: "),
            ({**body, "k": 100000}, 422, "k: "),
            ({**body, "text": "and words"}, 400, "exactly one of text, item_id or an image"),
            ({"item_id": "no-such.png"}, 404, "no live item 'no-such.png'"),
            ({**body, "alias": ["serving", "shadow"]}, 400, "add fuse rrf"),
            ({**body, "fuse": "max"}, 400, "unknown fusion 'max'"),
            ({**body, "query_class": "visual", "alias": ["shadow"]}, 400, "give no alias or fuse"),
            ({"image_b64": "not base64!"}, 400, "not base64"),
            ({"image_b64": base64.b64encode(b"just bytes").decode()}, 400, "UnidentifiedImageError"),
            ({**body, "url": "http://169.254.169.254/"}, 422, "url: "),
            ({**body, "alias": ["captions"]}, 400, "not served here")):
        refused = httpx.post(f"{url}/search", json=bad, headers=_auth())
        assert refused.status_code == status and says in refused.json()["detail"], (bad.keys(), refused.text)
        assert "Traceback" not in refused.text
    metrics = httpx.get(f"{url}/metrics", headers=_auth()).text  # a request's alias names never become labels
    assert 'alias="captions"' not in metrics and 'alias="not served",route="/search",status="400"' in metrics


def _cli_hits(store, *args: str) -> list[dict]:
    cli = CliRunner().invoke(app, ["search", "--store", str(store), *args, "--json", "--device", "cpu"])
    assert cli.exit_code == 0, cli.output
    return json.loads(cli.stdout)["results"][0]["hits"]


def _same(hits: list[dict], expected: list[dict]) -> None:
    assert [h["item_id"] for h in hits] == [h["item_id"] for h in expected]
    assert [h["score"] for h in hits] == pytest.approx([h["score"] for h in expected], abs=1e-5)


def test_item_id_fusion_routing_and_uploads_answer_as_the_command_does(served):
    url, store, image = served["url"], served["store"], served["cat"] / "007.png"
    b64 = base64.b64encode(image.read_bytes()).decode()
    with httpx.Client(base_url=url, headers=_auth(), timeout=30) as http:
        # more like this: the item's stored vector; the item itself is not among its hits
        by_item = http.post("/search", json={"item_id": "007.png", "k": 5}).json()
        assert "hits" in by_item, by_item
        by_item = by_item["hits"]
        _same(by_item, _cli_hits(store, "--item-id", "007.png", "--k", "5"))
        # the index's own copy of the vector (Flat) is the shard's, which compressed indexes read instead
        searcher = Searcher(str(store), "serving", device="cpu")
        shards = StoredVectors(served["location"], served["slug"], searcher.spec.dim)
        assert np.allclose(shards.vector("007.png"), searcher.stored_vector("007.png"), atol=1e-6)
        with pytest.raises(ItemNotFound, match="no live item"):
            shards.vector("no-such.png")
        by_image = http.post("/search", json={"image_b64": b64, "k": 6}).json()["hits"]  # its own picture
        assert by_image[0]["item_id"] == "007.png" and [h["item_id"] for h in by_item] == \
            [h["item_id"] for h in by_image[1:]]

        fused = http.post("/search", json={"image_b64": b64, "k": 5, "alias": ["serving", "shadow"],
                                           "fuse": "rrf"}).json()
        _same(fused["hits"], _cli_hits(store, "--image", str(image), "--k", "5", "--alias", "serving", "--alias",
                                       "shadow", "--fuse", "rrf"))
        assert fused["hits"][0]["found_by"] == [{"alias": "serving", "rank": 1}, {"alias": "shadow", "rank": 1}]
        assert {(h["alias"], h["version"]) for h in fused["hits"]} <= {("serving", 1), ("shadow", 2)}

        for query_class, aliases in (("mixed", ["serving", "shadow"]), ("visual", ["serving"]), ("other", ["shadow"])):
            routed = http.post("/search", json={"image_b64": b64, "k": 5, "query_class": query_class}).json()
            _same(routed["hits"], _cli_hits(store, "--image", str(image), "--k", "5", "--route", str(served["route"]),
                                            "--query-class", query_class))
            assert routed["how"]["aliases"] == aliases

        uploaded = http.post("/search", files={"image": ("007.png", image.read_bytes(), "image/png")},
                             data={"k": "5", "where": "price < 9"}).json()["hits"]
        _same(uploaded, http.post("/search", json={"image_b64": b64, "k": 5, "where": "price < 9"}).json()["hits"])
        assert uploaded[0]["item_id"] == "007.png" and all(h["metadata"]["price"] < 9 for h in uploaded)

        from imgest.tasks.search.service import MAX_BODY_BYTES, MAX_IMAGE_BYTES

        too_big = http.post("/search", files={"image": ("big.png", b"\0" * (MAX_IMAGE_BYTES + 1), "image/png")})
        assert too_big.status_code == 413 and "image larger than" in too_big.json()["detail"]
        body = http.post("/search", content=b" " * (MAX_BODY_BYTES + 1), headers={"content-type": "application/json"})
        assert body.status_code == 413 and "body larger than" in body.json()["detail"]

        def chunks():
            for _ in range(MAX_BODY_BYTES // (1 << 20) + 2):
                yield b" " * (1 << 20)

        chunked = http.post("/search", content=chunks(), headers={"content-type": "application/json"})
        assert chunked.status_code == 413, chunked.text
        two_files = http.post("/search", files=[("image", ("a.png", b"x")), ("other", ("b.png", b"y"))])
        assert two_files.status_code in (400, 422) and "Traceback" not in two_files.text


def test_an_alias_moved_under_concurrent_requests_fails_none(served):
    url, follower, location, slug = served["url"], served["follower"], served["location"], served["slug"]
    body = {"image_b64": base64.b64encode((served["cat"] / "003.png").read_bytes()).decode(), "k": 3}
    statuses, versions, stop = [], [], threading.Event()

    def client() -> None:
        with httpx.Client(headers=_auth(), timeout=30) as http:
            while not stop.is_set():
                answer = http.post(f"{url}/search", json=body)
                statuses.append(answer.status_code)
                if answer.status_code == 200:
                    versions.append(answer.json()["hits"][0]["version"])

    clients = [threading.Thread(target=client, daemon=True) for _ in range(3)]
    for thread in clients:
        thread.start()
    try:
        for version in (2, 1, 2):
            set_alias(location, "serving", read_card(location, slug, version), f"test: to v{version}")
            assert follower.refresh() == ["serving"]
            before = len(versions)
            deadline = time.monotonic() + 20
            while len(versions) < before + 10 and time.monotonic() < deadline:
                time.sleep(0.02)
    finally:
        stop.set()
        for thread in clients:
            thread.join(timeout=30)
    assert statuses and set(statuses) == {200}
    assert set(versions) == {1, 2}
    assert httpx.get(f"{url}/aliases", headers=_auth()).json()["serving"]["version"] == 2
    metrics = httpx.get(f"{url}/metrics", headers=_auth()).text
    assert f'imgest_api_requests_total{{alias="serving",route="/search",status="200"}} {float(len(statuses))}' \
        in metrics
    assert f'imgest_api_served_version{{alias="serving",model="{slug}"}} 2.0' in metrics
    assert "imgest_api_alias_swaps 3.0" in metrics and 'imgest_api_alias_load_failed{alias="serving"} 0.0' in metrics
    assert 'imgest_api_request_seconds_count{alias="serving",route="/search"}' in metrics


def test_the_command_serves_the_page_and_follows_with_its_options(served, tmp_path):
    """`imgest api` as a user starts it: its flags reach the service (the routing table, the token from the
    environment), and bad flags exit 2 in one line before anything listens."""
    import os
    import socket
    import subprocess
    import sys

    bad = CliRunner().invoke(app, ["api", "--store", str(served["store"]), "--shadow-share", "1.5"])
    assert bad.exit_code == 2 and "--shadow-share must be between 0 and 1" in bad.output
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "IMGEST_API_TOKEN": TOKEN}
    command = [os.path.join(os.path.dirname(sys.executable), "imgest"), "api", "--store", str(served["store"]),
               "--port", str(port), "--route", str(served["route"]), "--shadow-share", "0.5", "--device", "cpu"]
    service = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert "<title>imgest search</title>" in httpx.get(url).text  # the page itself needs no token
        assert set(httpx.get(f"{url}/aliases", headers=_auth()).json()) == {"serving", "shadow"}  # --route's
        routed = httpx.post(f"{url}/search", json={"item_id": "007.png", "query_class": "mixed"}, headers=_auth())
        assert routed.status_code == 200 and routed.json()["how"]["route"] == "rrf", routed.text
    finally:
        service.terminate()
        output = service.communicate(timeout=60)[0]
    assert TOKEN not in output and "Traceback" not in output, output


def test_thumbnails_are_read_only_under_the_catalogue_root_and_bounded(tmp_path):
    import io

    from PIL import Image

    from imgest.state.catalogue_images import record_root
    from imgest.storage import ContainmentError, RecordError
    from imgest.tasks.search import thumbnails

    cat, store = tmp_path / "cat", Location(str(tmp_path / "store"))
    write_files(str(cat), {"a.png": png_bytes(gradient(1, (600, 300))), "big.png": b"x" * 2048})
    record_root(store, "m", Location(str(cat)))
    root = Location(str(cat)).uri().rstrip("/")
    thumbs = thumbnails.Thumbnails(store)
    small = Image.open(io.BytesIO(thumbs.get("m", f"{root}/a.png")))
    assert small.format == "JPEG" and max(small.size) == thumbnails.SIDE
    with pytest.raises(ContainmentError):
        thumbs.get("m", str(tmp_path / "store" / "state" / "model=m" / "catalogue.json"))
    original, thumbnails.MAX_SOURCE_BYTES = thumbnails.MAX_SOURCE_BYTES, 1024
    try:
        with pytest.raises(RecordError, match="larger than 1024 bytes"):
            thumbs.get("m", f"{root}/big.png")
    finally:
        thumbnails.MAX_SOURCE_BYTES = original


def test_the_search_page_searches_by_image_filters_and_shows_thumbnails_in_chromium(served):
    import shutil

    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    assert chromium, "Chromium is missing: infra/setup.sh installs Debian's chromium for this check"
    cards = "#results article.hit"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(served["url"] + "/", wait_until="domcontentloaded")
            page.locator("#token").fill(TOKEN)  # the page asks for the token when the service wants one
            page.locator("#token").dispatch_event("change")
            page.wait_for_function("() => document.querySelector('#status').textContent === 'ready'")
            assert page.locator("#alias option").all_inner_texts() == [
                f"serving ({served['slug']} v1)", f"shadow ({served['slug']} v2)", "all, fused (rrf)"]

            page.locator("#file").set_input_files(str(served["cat"] / "007.png"))
            page.wait_for_function(f"() => document.querySelectorAll('{cards}').length === 20")
            assert page.locator(cards).first.get_attribute("data-item") == "007.png"
            assert "gradient 7" in page.locator(cards).first.inner_text()
            page.wait_for_function(f"() => [...document.querySelectorAll('{cards} img')]"
                                   ".every(i => i.complete && i.naturalWidth > 0)", timeout=30_000)

            page.locator("input[data-column='price'][data-op='<=']").fill("2.5")  # a filter from the metadata
            page.locator("#go").click()
            page.wait_for_function(f"() => document.querySelectorAll('{cards}').length === 3")
            assert sorted(page.locator(cards).evaluate_all("cs => cs.map(c => c.dataset.item)")) == \
                ["000.png", "001.png", "002.png"]

            page.locator("input[data-column='price'][data-op='<=']").fill("")
            page.locator("#alias").select_option("shadow")
            liked = page.locator(cards).first.get_attribute("data-item")
            page.locator(f"{cards} button").first.click()  # more like this: the item's own vector
            page.wait_for_function("() => document.querySelector('#status').textContent.includes('more like')")
            items = page.locator(cards).evaluate_all("cs => cs.map(c => c.dataset.item)")
            assert len(items) == 20 and liked not in items
            assert "shadow" in page.locator(cards).first.inner_text()
        finally:
            browser.close()
