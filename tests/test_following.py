"""A long-lived searcher follows its alias: moves are swapped in under concurrent queries with none failing, a
version that fails to load leaves the old one serving and is reported, a background thread notices moves."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from imgest.config import IndexConfig
from imgest.flows.build_index import build_index
from imgest.retrieval.following import FollowingSearcher
from imgest.retrieval.query import SearchError
from imgest.retrieval.versions import read_card
from imgest.state.aliases import set_alias
from imgest.storage import Location
from tests.helpers import gradient, ingest_into, png_bytes, write_files

pytestmark = pytest.mark.usefixtures("prefect_harness")
MODEL = "raw-pixels"


def test_the_alias_moves_under_concurrent_queries_and_none_fails(tmp_path):
    cat, store = tmp_path / "cat", tmp_path / "store"
    write_files(str(cat), {f"{i:03d}.png": png_bytes(gradient(i)) for i in range(30)})
    ingest_into(cat, store, model=MODEL, batch_size="8")
    cards = []
    for _ in range(3):  # versions 1, 2, 3 of the same vectors; serving ends on 3
        cards.append(build_index(IndexConfig(store=str(store), model=MODEL, alias="serving", rebuild=True))["card"])
    location = Location(str(store))
    slug = cards[0]["slug"]
    set_alias(location, "serving", read_card(location, slug, 1), "test: start on v1")

    follower = FollowingSearcher(str(store), ("serving",), device="cpu")
    assert not follower.ready()
    with pytest.raises(SearchError, match="not loaded yet"):
        follower.search_vectors(np.ones((1, 4), np.float32))
    assert follower.refresh() == ["serving"] and follower.ready()
    assert follower.status()["serving"]["version"] == 1 and follower.status()["serving"]["error"] is None
    dim = follower._take("serving").searcher.spec.dim
    query = np.ones((1, dim), np.float32) / np.sqrt(dim)
    first = follower.search_vectors(query, k=5)
    assert (first.alias, first.model, first.version) == ("serving", slug, 1) and len(first.hits[0]) == 5

    answered, errors, stop = [], [], threading.Event()

    def client() -> None:
        while not stop.is_set():
            try:
                answer = follower.search_vectors(query, k=5)
                answered.append((answer.version, [h.item_id for h in answer.hits[0]]))
            except Exception as exc:  # noqa: BLE001 - any failed query fails the test
                errors.append(exc)

    clients = [threading.Thread(target=client, daemon=True) for _ in range(3)]
    for thread in clients:
        thread.start()
    try:
        for version in (2, 1, 3):  # promote, rollback, promote again
            set_alias(location, "serving", read_card(location, slug, version), f"test: to v{version}")
            assert follower.refresh() == ["serving"]
            assert follower.status()["serving"]["version"] == version
            before = len(answered)  # then some queries on the new version
            deadline = time.monotonic() + 10
            while len(answered) < before + 20 and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        stop.set()
        for thread in clients:
            thread.join()
    assert not errors, errors[:3]
    assert {version for version, _ in answered} == {1, 2, 3} and follower.swaps == 3
    assert len({tuple(items) for _, items in answered}) == 1  # the same vectors in every version: the same hits
    assert follower.refresh() == []  # nothing moved: nothing loaded

    # a version that fails its checksum: the alias moves to it, the old version keeps serving, the failure shows
    path = store / read_card(location, slug, 2)["index_file"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    set_alias(location, "serving", read_card(location, slug, 2), "test: to a damaged v2")
    assert follower.refresh() == []
    status = follower.status()["serving"]
    assert status["version"] == 3 and "corrupted" in status["error"]
    assert follower.search_vectors(query, k=5).version == 3

    # followed from a background thread: a move back to v1 is noticed without a call
    follower.follow(every=0.05)
    try:
        set_alias(location, "serving", read_card(location, slug, 1), "test: back to v1")
        deadline = time.monotonic() + 10
        while follower.status()["serving"]["version"] != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert follower.status()["serving"] == {**follower.status()["serving"], "version": 1, "error": None}
    finally:
        follower.close()
