"""Catalogue keys are untrusted: S3 allows any UTF-8 up to 1,024 bytes. A catalogue whose keys hold every class of
character S3 allows (quotes, backslashes, glob and LIKE wildcards, braces, SQL and filter syntax, Unicode in both
normal forms, 1,024-byte keys) synced to Milvus Lite, Qdrant's local mode and LanceDB: the first sync carries every
item, a night that deletes and changes some of them leaves each engine holding exactly the live ids (read back
with the engine's own client, no id in a filter), metadata included."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from imgest.config import SyncConfig
from imgest.tasks.sync.run import sync
from imgest.tasks.sync.targets import open_target, parse_target
from tests.helpers import gradient, ingest_into, png_bytes, write_files
from tests.test_sync import ENGINES, MODEL, _live, _url


def _sized(pattern: str, size: int) -> str:
    """`pattern` repeated to exactly `size` UTF-8 bytes (whole characters, then ASCII to fill)."""
    text = ""
    for char in pattern * size:
        if len((text + char).encode()) > size:
            break
        text += char
    return text + "x" * (size - len(text.encode()))


def _long_key(pattern: str) -> str:
    """A key of exactly 1,024 bytes, S3's limit: four folders of 200 bytes (a local file system's names stop at
    255) and a 220-byte file name."""
    key = "/".join(_sized(pattern, 200) for _ in range(4)) + "/" + _sized(pattern, 216) + ".png"
    assert len(key.encode()) == 1024
    return key


LONG_HOSTILE = _long_key("q'\"b\\%*?[{é ")
LONG_WIDE = _long_key("日本語写真")
KEYS = [
    "plain/000.png",
    "quotes/it's.png", 'quotes/say "cheese".png', "quotes/''.png", "quotes/'.png", 'quotes/".png',
    "backslash/back\\slash.png", "backslash/end\\.png", "backslash/\\'.png", "backslash/\\\\.png",
    "backslash/\\u0041.png", "backslash/\\n.png", 'backslash/\\".png', "backslash/\\x41\\s.png",
    "wild/100%.png", "wild/*.png", "wild/what?.png", "wild/[abc].png", "wild/{a,b}.png", "wild/_%_.png",
    "wild/%s%d%%.png", "wild/{ids}.png",
    "sql/x' OR '1'='1.png", "sql/a'); DELETE FROM products; --.png", "sql/semi;colon -- comment.png", "sql/a* c *b.png",
    "filter/x'] or item_id != ['y.png", 'filter/x"] || item_id != ["y.png', 'filter/item_id like "%".png',
    "filter/$(touch pwned).png", 'filter/json {"k": [1]}.png', "filter/id in [1, 2].png",
    "unicode/café.png", "unicode/cafe\u0301.png", "unicode/日本語 写真.png", "unicode/emoji 🎉.png",
    "unicode/\u202eRTL.png", "unicode/zero\u200bwidth.png", "unicode/nbsp\u00a0.png", "spaces/ lead and trail .png",
    LONG_HOSTILE, LONG_WIDE,
]
DELETED = [k for k in KEYS if k.startswith("filter/")] + ["backslash/back\\slash.png", "quotes/it's.png",
                                                           "unicode/cafe\u0301.png", LONG_WIDE, "wild/*.png"]
CHANGED = ["sql/x' OR '1'='1.png", "backslash/\\'.png", LONG_HOSTILE, "wild/[abc].png"]
ADDED = ["new/it's back\\.png", 'new/"]; drop.png']


def _write(tmp_path, images: dict[str, int], titles: dict[str, str]) -> None:
    """The catalogue's files (stale ones removed) and its metadata as Parquet (no CSV quoting in the way)."""
    cat = tmp_path / "cat"
    for old in (p for p in cat.rglob("*") if p.is_file()) if cat.exists() else []:
        if old.relative_to(cat).as_posix() not in images:
            old.unlink()
    write_files(str(cat), {key: png_bytes(gradient(seed)) for key, seed in images.items()})
    keys = sorted(images)
    pq.write_table(pa.table({"item_id": keys, "title": [titles[k] for k in keys]}), tmp_path / "meta.parquet")


def _night(tmp_path, images, titles) -> None:
    _write(tmp_path, images, titles)
    result = ingest_into(tmp_path / "cat", tmp_path / "store", model=MODEL, batch_size="8",
                         metadata=str(tmp_path / "meta.parquet"), shard_size=8, max_delete_fraction=0.5)
    assert not result["rejected"], result  # every key is an image the ingest took


def _engine_ids(target) -> list[str]:
    """Every item_id the collection the target's name answers for holds, read with the engine's own client and
    no id in a filter (what a user of the collection meets)."""
    if target.spec.engine == "lancedb":
        return target.table.to_arrow()["item_id"].to_pylist()
    if target.spec.engine == "qdrant":
        points, _ = target.client.scroll(target.collection, limit=10_000, with_payload=["item_id"])
        return [p.payload["item_id"] for p in points]
    rows = target.client.query(target.collection, filter="", output_fields=["item_id"], limit=10_000)
    return [row["item_id"] for row in rows]


def _holds_exactly_the_live_items(url: str, tmp_path, titles: dict[str, str], gone: list[str]) -> None:
    live, card = _live(tmp_path)
    assert sorted(live.item_ids) == sorted(titles)  # the store took every key as it is
    target = open_target(parse_target(url))
    try:
        assert target.open_named() == card["model_id"]
        assert sorted(_engine_ids(target)) == sorted(titles)  # each once: no id lost, none doubled
        assert target.count() == len(titles)
        rows = target.get(sorted(titles))  # ids as values of the engine's filter, or its point ids
        assert {item_id: row["title"] for item_id, row in rows.items()} == titles
        assert target.get(gone) == {}
    finally:
        target.close()


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.parametrize("engine", ENGINES)
def test_every_key_s3_allows_reaches_every_engine_and_leaves_it_when_deleted(engine, tmp_path):
    url = _url(engine, tmp_path)
    images = {key: i for i, key in enumerate(KEYS)}
    titles = {key: f"title of {key}" for key in KEYS}
    _night(tmp_path, images, titles)
    first = sync(SyncConfig(store=str(tmp_path / "store"), to=url, model=MODEL, batch=7))
    assert (first["upserted"], first["deleted"], first["live"]) == (len(KEYS), 0, len(KEYS))
    _holds_exactly_the_live_items(url, tmp_path, titles, [])

    # a night that deletes some of them (the filter-syntax ones among them), changes others' bytes or titles,
    # adds new ones
    for key in DELETED:
        del images[key], titles[key]
    for n, key in enumerate(CHANGED):
        images[key] = 1000 + n
    titles["unicode/emoji 🎉.png"] = "a new 'title' with \\ and \""
    images.update({key: 2000 + n for n, key in enumerate(ADDED)})
    titles.update({key: f"title of {key}" for key in ADDED})
    _night(tmp_path, images, titles)
    second = sync(SyncConfig(store=str(tmp_path / "store"), to=url, model=MODEL, batch=4))
    assert (second["upserted"], second["deleted"]) == (len(CHANGED) + 1 + len(ADDED), len(DELETED))
    assert second["live"] == len(images)
    _holds_exactly_the_live_items(url, tmp_path, titles, DELETED)
