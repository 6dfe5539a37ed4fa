"""What made a version's vectors: its card counts the indexed rows per runtime and precision, and per JPEG decoder,
read from each shard's own metadata as the build reads the shard (an update from the live shards' footers), and
`imgest status` shows each mix behind the serving version in one line."""

import json
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from imgest import encoders
from imgest.cli import app
from imgest.state.committed import load_state, write_model_card
from imgest.state.layout import shard_key, snapshot_key
from imgest.state.live import LiveShards
from imgest.state.shards import shard_encoder
from imgest.storage import Location
from imgest.tasks.index.build import train
from imgest.tasks.index.choice import choose_index
from imgest.tasks.index.parts import add_store_part, plan_parts
from imgest.tasks.index.stream import stream_build
from imgest.tasks.ingest.plan import ShardPlan, WorkItem
from imgest.tasks.ingest.writer import ShardWriter
from tests.test_index_stream import state_rows

SPEC = encoders.resolve("raw-pixels-2")  # d = 12
SIZE = 200  # rows per shard


def ingest_shards(store: Location, seq: int, runtime: str, precision: str, keys: list[str], seed: int,
                  decoder: str = "simplejpeg") -> list[str]:
    """One ingest run's shards of `keys`, written by the project's shard writer with the run's runtime, precision
    and JPEG decoder (what an ingest with --runtime/--precision/--decoder records); returns each key's shard."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(8, SPEC.dim))
    vectors = (centres[rng.integers(0, 8, len(keys))] + 0.4 * rng.normal(size=(len(keys), SPEC.dim)))
    vectors = (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)
    shards = []
    for number, begin in enumerate(range(0, len(keys), SIZE)):
        part = keys[begin:begin + SIZE]
        plan = ShardPlan(f"r{seq:08d}-20261204T000000-aaaaaa", number,
                         tuple(WorkItem(k, f"s3://shop/{k}", 1, 0.0, "e", None) for k in part))
        writer = ShardWriter(store, SPEC, plan, runtime=runtime, precision=precision, decoder=decoder)
        writer.add([(item, f"h-{item.item_id}") for item in plan.items], vectors[begin:begin + len(part)])
        writer.flush()
        shards += [plan.name] * len(part)
    return shards


def unrecord(store: Location, shard: str) -> None:
    """Rewrite a shard as one written before the writer recorded its runtime, precision and decoder."""
    path = store.path(shard_key(SPEC.slug, shard))
    table = pq.read_table(path)
    meta = {k: v for k, v in table.schema.metadata.items()
            if k not in (b"imgest.runtime", b"imgest.precision", b"imgest.decoder")}
    pq.write_table(table.replace_schema_metadata(meta), path)


def snapshot(folder, seq: int, keys: list[str], shards: list[str], deleted: set[str] = frozenset()) -> None:
    status = ["deleted" if k in deleted else "live" for k in keys]
    path = folder / snapshot_key(SPEC.slug, seq)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(state_rows(keys, status, shards).sort_by("item_id"), path)


def mixed_store(folder, missing: bool = True):
    """Two ingests at different precisions and decoders: 600 items by openvino fp32 from simplejpeg's pixels (the
    first shard's metadata from before the runtime was recorded; one item without its row when `missing`), then 400
    by torch bf16 from Pillow's (2 of them deleted since). Returns (store, keys, shards) and the indexed rows per
    encoder (per decoder: `decoded`)."""
    store = Location(str(folder))
    write_model_card(store, SPEC.describe())
    first = [f"catalogue/a/{i:05d}.jpg" for i in range(600)]
    second = [f"catalogue/b/{i:05d}.jpg" for i in range(400)]
    shards = ingest_shards(store, 1, "openvino", "fp32", first, seed=1)
    shards += ingest_shards(store, 2, "torch", "bf16", second, seed=2, decoder="pillow")
    unrecord(store, shards[0])
    if missing:  # its shard without its row: indexed without it
        path = store.path(shard_key(SPEC.slug, shards[SIZE]))
        table = pq.read_table(path)
        pq.write_table(table.filter(pa.array(np.asarray(table["item_id"].to_pylist()) != first[SIZE + 7])), path)
    keys = first + second
    snapshot(folder, 2, keys, shards, deleted=set(second[:2]))
    expected = {"unrecorded": SIZE, "openvino fp32": 2 * SIZE - missing, "torch bf16": 400 - 2}
    return store, keys, shards, expected


def decoded(missing: bool = True) -> dict[str, int]:
    """`mixed_store`'s indexed rows per JPEG decoder."""
    return {"unrecorded": SIZE, "simplejpeg": 2 * SIZE - missing, "pillow": 400 - 2}


def test_the_label_is_the_shards_own_metadata_and_a_hostile_value_is_not_printed():
    assert shard_encoder({b"imgest.runtime": b"torch", b"imgest.precision": b"bf16"}) == "torch bf16"
    assert shard_encoder({"imgest.runtime": "openvino", "imgest.precision": "fp32"}) == "openvino fp32"
    assert shard_encoder({b"imgest.version": b"0.1.0"}) == shard_encoder(None) == "unrecorded"
    assert shard_encoder({b"imgest.runtime": b"\x1b[2J", b"imgest.precision": b"fp32"}) == "unrecorded"


@pytest.mark.parametrize("factory", ["IVF8,SQ8", "Flat"])  # added shard by shard; through a memory map
def test_a_streamed_build_counts_the_rows_it_indexed_by_what_encoded_each_shard(tmp_path, factory):
    store, _, _, expected = mixed_store(tmp_path)
    state = load_state(store, SPEC.slug)
    live = LiveShards(state)
    state.close()
    choice = choose_index(len(live), SPEC.dim, "1G", factory, "unlimited")
    got = stream_build(store, SPEC.slug, SPEC.dim, live, choice, queries=20, depth=10)
    assert got.encoded_by == expected and sum(expected.values()) == got.index.ntotal == 997
    assert got.decoded_by == decoded()


def test_parts_that_read_their_own_shards_count_them_too(tmp_path):
    store, _, _, expected = mixed_store(tmp_path, missing=False)
    state = load_state(store, SPEC.slug)
    live = LiveShards(state)
    state.close()
    choice = choose_index(len(live), SPEC.dim, "1G", "IVF8,SQ8", "unlimited")
    sample = np.random.default_rng(0).normal(size=(800, SPEC.dim)).astype(np.float32)
    import faiss

    trained = faiss.serialize_index(train(sample, choice)).tobytes()
    parts = [add_store_part(trained, spec, sample[:5], 10) for spec in plan_parts(store.url, SPEC.slug, SPEC.dim,
                                                                                   live, 3)]
    assert len(parts) == 3
    total = {}
    for part in parts:
        for label, rows in part["encoded_by"].items():
            total[label] = total.get(label, 0) + rows
    assert total == expected == {"unrecorded": 200, "openvino fp32": 400, "torch bf16": 398}
    assert sum((Counter(part["decoded_by"]) for part in parts), Counter()) == decoded(missing=False)


@pytest.mark.usefixtures("prefect_harness")
def test_the_card_and_status_show_the_mix_and_a_nightly_update_keeps_it_right(tmp_path):
    from imgest.config import IndexConfig
    from imgest.flows.build_index import build_index

    store, keys, shards, expected = mixed_store(tmp_path)
    common = {"store": str(tmp_path), "model": SPEC.name, "kind": "IVF8,SQ8", "queries": 100, "target_recall": 0.5}
    v1 = build_index(IndexConfig(**common))["card"]
    assert v1["lineage"]["method"] == "build" and v1["n"] == 997
    assert v1["encoded_by"] == expected == {"unrecorded": 200, "openvino fp32": 399, "torch bf16": 398}
    assert json.loads((tmp_path / v1["ids_file"]).with_name("card.json").read_text())["encoded_by"] == expected
    assert v1["decoded_by"] == decoded() == {"unrecorded": 200, "simplejpeg": 399, "pillow": 398}

    result = CliRunner().invoke(app, ["status", "--store", str(tmp_path)])
    assert result.exit_code == 0, result.output
    # 399 / 997 = 40.02%, 398 / 997 = 39.92%, 200 / 997 = 20.06%: the most first, in one line
    assert f"serving: model={SPEC.slug} v0001, 997 vectors, encoded by: openvino fp32 40.0%, torch bf16 39.9%, " \
           "unrecorded 20.1%\n  JPEGs decoded by: simplejpeg 40.0%, pillow 39.9%, unrecorded 20.1%\n" in result.output
    shown = json.loads(CliRunner().invoke(app, ["status", "--store", str(tmp_path), "--json"]).output)
    assert shown["serving"]["encoded_by"] == expected and shown["serving"]["version"] == 1

    # the next night: 30 items encoded at torch fp32, 5 of the first run's deleted; the version is updated in place
    third = [f"catalogue/c/{i:05d}.jpg" for i in range(30)]
    shards += ingest_shards(store, 3, "torch", "fp32", third, seed=3, decoder="turbojpeg")
    keys += third
    snapshot(tmp_path, 3, keys, shards, deleted={*keys[600:602], *keys[300:305]})
    v2 = build_index(IndexConfig(**common))["card"]
    assert v2["lineage"]["method"] == "update", v2["lineage"]["why"]
    assert (v2["lineage"]["added"], v2["lineage"]["removed"], v2["n"]) == (30, 5, 1022)
    assert v2["encoded_by"] == {"unrecorded": 200, "openvino fp32": 394, "torch bf16": 398, "torch fp32": 30}
    assert v2["decoded_by"] == {"unrecorded": 200, "simplejpeg": 394, "pillow": 398, "turbojpeg": 30}
    result = CliRunner().invoke(app, ["status", "--store", str(tmp_path)])
    # 394 / 1022 = 38.55%, 398 / 1022 = 38.94%, 200 / 1022 = 19.57%, 30 / 1022 = 2.94%
    assert "v0002, 1,022 vectors, encoded by: torch bf16 38.9%, openvino fp32 38.6%, unrecorded 19.6%, " \
           "torch fp32 2.9%\n" in result.output


def test_an_update_reads_two_footers_per_run_and_every_footer_of_a_run_that_differs(tmp_path, monkeypatch):
    from imgest.tasks.index.update import made_by_shards

    store = Location(str(tmp_path))
    labels = {"part-r00000001-a-00000": "openvino bf16", "part-r00000001-a-00001": "openvino bf16",
              "part-r00000001-a-00002": "openvino bf16", "part-r00000001-a-00003": "openvino bf16",
              "part-r00000002-b-00000": "torch fp32", "part-r00000002-b-00001": "openvino fp32",
              "part-r00000002-b-00002": "openvino fp32"}
    for shard, label in labels.items():
        runtime, precision = label.split()
        path = tmp_path / shard_key(SPEC.slug, shard)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"item_id": ["x"]}).replace_schema_metadata(
            {"imgest.runtime": runtime, "imgest.precision": precision, "imgest.decoder": "pillow"}), path)
    read = []
    footer = store.read_parquet_metadata
    monkeypatch.setattr(store, "read_parquet_metadata", lambda key: read.append(key) or footer(key))
    by_shard = pa.table({"shard": [*labels, None], "rows": [10, 20, 30, 40, 1, 2, 4, 7]})
    encoded, decoded = made_by_shards(store, SPEC.slug, by_shard)
    assert encoded == {"openvino bf16": 100, "torch fp32": 1, "openvino fp32": 6, "unrecorded": 7}
    assert decoded == {"pillow": 107, "unrecorded": 7}
    assert len(read) == 2 + 3  # the first run's two ends; every shard of the run whose ends differ
