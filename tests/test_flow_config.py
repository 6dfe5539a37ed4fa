"""Every flow validates its whole configuration on its first line: a deployment run with a bad value fails
with one line naming the field, before any listing, encoding, lock or write (the same lines as the CLI)."""

from __future__ import annotations

import os

import pytest

from imgest.config import ConfigError, EvalConfig, IndexConfig, MigrateConfig, NightlyConfig, TrainHeadConfig
from imgest.tasks.heads import HeadConfig, HeadError


@pytest.mark.parametrize("build,match", [
    (lambda: NightlyConfig(catalogue="c", store="s", memory="4Q"), "memory must look like 4G"),
    (lambda: NightlyConfig(catalogue="c", store="s", kind="bogus"), "kind must be one of auto, flat"),
    (lambda: NightlyConfig(catalogue="c", store="s", index_parts=0), "parts must be an integer >= 1"),
    (lambda: NightlyConfig(catalogue="c", store="s", shard_size=0), "shard_size must be an integer >= 1"),
    (lambda: NightlyConfig(catalogue="c", store="s", runner="ray"), "runner must be local, dask"),
    (lambda: IndexConfig(store="s", target_recall=1.5), r"target_recall must be in \(0, 1\]"),
    (lambda: IndexConfig(store="s", alias="Serving!"), "alias must be lowercase"),
    (lambda: MigrateConfig(store="s", action="launch"), "action must be one of start, status, promote"),
    (lambda: MigrateConfig(store="s", action="start"), "to must not be empty"),
    (lambda: MigrateConfig(store="s", action="finish", retain_days=-1), "retain_days must be a number >= 0"),
    (lambda: EvalConfig(store="s", queries="q.jsonl", ks=(0, 5)), "ks must be positive integers"),
    (lambda: EvalConfig(store="s", queries="q.jsonl", device="tpu"), "device must be one of auto, cpu, cuda"),
    (lambda: TrainHeadConfig(store="s", views=0), "views must be an integer >= 1"),
])
def test_configurations_name_the_field_and_what_is_allowed(build, match):
    with pytest.raises(ConfigError, match=match):
        build()


def test_training_parameters_are_checked_with_the_head_configuration():
    with pytest.raises(HeadError, match="loss must be one of triplet, infonce, proxynca"):
        TrainHeadConfig(store="s", training=HeadConfig(loss="arcface"))


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.parametrize("call,error,match", [
    ("nightly", ConfigError, "memory must look like 4G"),
    ("nightly-kind", ConfigError, "kind must be one of"),
    ("ingest", ConfigError, "batch_size must be 'auto'"),
    ("reencode", ConfigError, "decode_workers must be an integer >= 0"),
    ("build-index", ConfigError, "memory must look like 4G"),
    ("migrate", ConfigError, "kind must be one of"),
    ("eval", ConfigError, "resamples must be an integer >= 1"),
    ("train-head", HeadError, "items_per_label must be >= 2"),
])
def test_a_flow_run_with_a_bad_value_fails_before_touching_anything(tmp_path, call, error, match):
    from imgest.flows.build_index import build_index
    from imgest.flows.evaluate import evaluate
    from imgest.flows.ingest import ingest
    from imgest.flows.migrate import migrate
    from imgest.flows.nightly import nightly
    from imgest.flows.reencode import reencode
    from imgest.flows.train_head import train_head_flow

    catalogue, store = tmp_path / "catalogue", tmp_path / "store"
    catalogue.mkdir()
    (catalogue / "a.jpg").write_bytes(b"not read")
    runs = {
        "nightly": lambda: nightly(catalogue=str(catalogue), store=str(store), memory="4Q"),
        "nightly-kind": lambda: nightly(catalogue=str(catalogue), store=str(store), kind="bogus"),
        "ingest": lambda: ingest(catalogue=str(catalogue), store=str(store), batch_size="big"),
        "reencode": lambda: reencode(catalogue=str(catalogue), store=str(store), model="raw-pixels",
                                     decode_workers=-1),
        "build-index": lambda: build_index(store=str(store), memory="4Q"),
        "migrate": lambda: migrate(store=str(store), action="start", to="raw-pixels", kind="bogus"),
        "eval": lambda: evaluate(store=str(store), queries=str(tmp_path / "q.jsonl"), resamples=0),
        "train-head": lambda: train_head_flow(store=str(store), items_per_label=1),
    }
    with pytest.raises(error, match=match):
        runs[call]()
    assert not store.exists(), os.listdir(store)  # nothing listed, locked or written
