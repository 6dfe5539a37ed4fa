"""One configuration model per flow: the flow's parameter, the CLI's options and the UI's form all come from it.

A bad value fails with one line naming the field, before any listing, encoding, lock or write; a field added
to a model is an option of its command and a field of its flow's form with nothing else to edit; deployments
of an earlier version (flat parameters) still run.
"""

from __future__ import annotations

import os

import pytest
from prefect.exceptions import ParameterTypeError

from imgest.config import (
    CONFIGS,
    ConfigError,
    EvalConfig,
    HeadConfig,
    IndexConfig,
    IngestConfig,
    MigrateConfig,
    NightlyConfig,
    TrainHeadConfig,
    build,
)

# Imported before any test starts: the first import of a flow configures Prefect's logging, which replaces the
# root logger's handlers, caplog's among them, had a test already begun.
from imgest.flows.nightly import nightly
from imgest.flows.train_head import train_head_flow


@pytest.mark.parametrize("model,values,match", [
    (NightlyConfig, dict(catalogue="c", store="s", memory="4Q"), "memory must look like 4G"),
    (NightlyConfig, dict(catalogue="c", store="s", kind="bogus"), "kind must be one of auto, flat"),
    (NightlyConfig, dict(catalogue="c", store="s", index_parts=0), "index_parts must be an integer >= 1"),
    (NightlyConfig, dict(catalogue="c", store="s", shard_size=0), "shard_size must be an integer >= 1"),
    (NightlyConfig, dict(catalogue="c", store="s", runner="ray"), "runner must be local, dask"),
    (NightlyConfig, dict(catalogue="c", store="s", shard_sise=10), "shard_sise: Extra inputs are not permitted"),
    (IngestConfig, dict(catalogue="c", store="s", shard_size="many"), "shard_size: Input should be a valid integer"),
    (IngestConfig, dict(catalogue="c", store=" "), "store must not be empty"),
    (IndexConfig, dict(store="s", target_recall=1.5), r"target_recall must be in \(0, 1\]"),
    (IndexConfig, dict(store="s", alias="Serving!"), "alias must be lowercase"),
    (IndexConfig, dict(store="s", workers=2), "workers sets the size of a local Dask cluster"),
    (MigrateConfig, dict(store="s", action="launch"), "action must be one of start, status, promote"),
    (MigrateConfig, dict(store="s", action="start"), "to must not be empty"),
    (MigrateConfig, dict(store="s", action="start", to="m", inventory="s3://inv/manifest.json"),
     "inventory: name the bucket it lists with catalogue"),
    (MigrateConfig, dict(store="s", action="start", to="m", catalogue="/cat", inventory="s3://inv/manifest.json"),
     "inventory: an S3 Inventory lists an S3 bucket"),
    (MigrateConfig, dict(store="s", action="finish", retain_days=-1), "retain_days must be a number >= 0"),
    (EvalConfig, dict(store="s", queries="q.jsonl", ks=(0, 5)), "ks must be positive integers"),
    (EvalConfig, dict(store="s", queries="q.jsonl", ks="1,x"), "ks .--k. must be positive integers"),
    (EvalConfig, dict(store="s", queries="q.jsonl", device="tpu"), "device must be one of auto, cpu, cuda"),
    (TrainHeadConfig, dict(store="s", views=0), "views must be an integer >= 1"),
    (TrainHeadConfig, dict(store="s", augment="crop,sepia"), "unknown augmentation 'sepia'"),
    (TrainHeadConfig, dict(store="s", training={"loss": "arcface"}), "loss must be one of triplet, infonce"),
    (TrainHeadConfig, dict(store="s", training={"items_per_label": 1}), "items_per_label must be an integer >= 2"),
])
def test_configurations_name_the_field_and_what_is_allowed(model, values, match):
    with pytest.raises(ConfigError, match=match) as caught:
        build(model, values)
    assert "\n" not in str(caught.value)  # one line, as the CLI prints it


def test_a_url_carrying_a_secret_is_refused_without_echoing_it():
    with pytest.raises(ConfigError, match="carries credentials") as caught:
        build(IngestConfig, {"catalogue": "s3://AKIAXXXX:hunter2@bucket/cat", "store": "s"})
    assert "hunter2" not in str(caught.value)


def test_every_flow_takes_its_model_and_shows_every_field_with_help_in_the_ui():
    """Prefect's parameter schema (the UI's form, the API's validation) holds every field of the flow's model,
    nested models included, each with its description: a field added to a model is in the form."""
    from imgest.flows.build_index import build_index
    from imgest.flows.duplicates import duplicates
    from imgest.flows.evaluate import evaluate
    from imgest.flows.ingest import ingest
    from imgest.flows.migrate import migrate
    from imgest.flows.nightly import nightly
    from imgest.flows.reencode import reencode
    from imgest.flows.train_head import train_head_flow

    flows = {f.name: f for f in (ingest, reencode, build_index, nightly, migrate, evaluate, duplicates,
                                 train_head_flow)}
    assert set(flows) == set(CONFIGS)
    for name, model in CONFIGS.items():
        schema = flows[name].parameters.model_dump()
        assert list(schema["properties"]) == ["config"], name
        definitions = schema["definitions"]

        def check(model, definitions=definitions, flow=name):
            properties = definitions[model.__name__]["properties"]
            for field, info in model.model_fields.items():
                assert field in properties, f"{flow}: {model.__name__}.{field} is missing from the UI form"
                assert properties[field].get("description") == info.description, (flow, field)
                if isinstance(info.annotation, type) and hasattr(info.annotation, "model_fields"):
                    check(info.annotation)

        check(model)


def test_every_field_is_an_option_of_its_command_with_the_models_default_and_help():
    import typer.main

    from imgest.cli import app
    from imgest.cli.options import cli_fields

    group = typer.main.get_command(app)
    commands = {"ingest": ["ingest"], "reencode": ["reencode"], "build-index": ["build-index"],
                "nightly": ["nightly"], "eval": ["eval"], "duplicates": ["duplicates"], "train-head": ["train-head"],
                "migrate": [f"migrate {a}" for a in ("start", "status", "promote", "rollback", "finish")]}
    assert set(commands) == set(CONFIGS)

    def command(path: str):
        found = group
        for part in path.split():
            found = found.commands[part]
        return found

    for flow, model in CONFIGS.items():
        options = {}
        for path in commands[flow]:
            options.update({opt: p for p in command(path).params for opt in p.opts})
        for field in cli_fields(model, exclude=("action",)):  # migrate's action is the subcommand
            assert field.flag in options, f"{model.__name__}.{'.'.join(field.path)}: no {field.flag} in imgest {flow}"
            param = options[field.flag]
            if field.path[-1] != "gate":  # --gate is a file holding the report the flow takes
                assert param.default == (None if field.default is ... else field.default), (flow, field.flag)
                assert param.help == field.help, (flow, field.flag)


def test_the_cli_flags_users_know_keep_their_names():
    import typer.main

    from imgest.cli import app

    group = typer.main.get_command(app)
    flags = {p.opts[0] for p in group.commands["train-head"].params}
    assert {"--dim", "--loss", "--items-per-label", "--augment", "--eval-queries", "--json"} <= flags
    assert "--k" in {p.opts[0] for p in group.commands["eval"].params}
    assert {"--allow-mass-delete", "--report-duplicates", "--metadata", "--inventory"} <= \
        {p.opts[0] for p in group.commands["nightly"].params}


def test_flat_parameters_of_an_earlier_deployment_are_moved_into_the_config(caplog):
    """A deployment made before the configuration models passes flat parameters; the run goes on, warned."""
    with caplog.at_level("WARNING", logger="imgest.flows"):
        validated = nightly.validate_parameters({"catalogue": "demo/catalogue", "store": "demo/store",
                                                 "runner": "local", "memory": "2G"})
    assert validated["config"] == NightlyConfig(catalogue="demo/catalogue", store="demo/store", memory="2G")
    assert "store -> config.store" in caplog.text and "redeploy" in caplog.text
    validated = train_head_flow.validate_parameters({"store": "s", "loss": "triplet", "epochs": 3})
    assert validated["config"].training == HeadConfig(loss="triplet", epochs=3)
    with pytest.raises(Exception, match="shard_sise"):  # a name no version had is not guessed at
        nightly.validate_parameters({"catalogue": "c", "store": "s", "shard_sise": 10})


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.parametrize("call,match", [
    ("nightly", "memory must look like 4G"),
    ("nightly-kind", "kind must be one of"),
    ("ingest", "batch_size must be 'auto'"),
    ("reencode", "decode_workers must be an integer >= 0"),
    ("build-index", "memory must look like 4G"),
    ("migrate", "kind must be one of"),
    ("eval", "resamples must be an integer >= 1"),
    ("train-head", "items_per_label must be an integer >= 2"),
])
def test_a_flow_run_with_a_bad_value_fails_before_touching_anything(tmp_path, call, match):
    """Parameters as a deployment passes them (plain JSON): Prefect validates them against the model."""
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
    both = {"catalogue": str(catalogue), "store": str(store)}
    runs = {
        "nightly": lambda: nightly(config={**both, "memory": "4Q"}),
        "nightly-kind": lambda: nightly(config={**both, "kind": "bogus"}),
        "ingest": lambda: ingest(config={**both, "batch_size": "big"}),
        "reencode": lambda: reencode(config={**both, "model": "raw-pixels", "decode_workers": -1}),
        "build-index": lambda: build_index(config={"store": str(store), "memory": "4Q"}),
        "migrate": lambda: migrate(config={"store": str(store), "action": "start", "to": "raw-pixels",
                                           "kind": "bogus"}),
        "eval": lambda: evaluate(config={"store": str(store), "queries": str(tmp_path / "q.jsonl"), "resamples": 0}),
        "train-head": lambda: train_head_flow(config={"store": str(store), "training": {"items_per_label": 1}}),
    }
    with pytest.raises(ParameterTypeError, match=match):
        runs[call]()
    assert not store.exists(), os.listdir(store)  # nothing listed, locked or written


def test_the_configuration_reference_is_generated_from_the_models():
    from pathlib import Path

    from imgest.cli.reference import render

    page = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
    assert page.read_text() == render(), "run: python -m imgest.cli.reference > docs/configuration.md"


def test_every_augmentation_the_config_accepts_is_one_the_views_apply():
    """train-head's `augment` is checked against imgest.names; the views module must apply exactly those."""
    from imgest.names import AUGMENTATIONS
    from imgest.tasks.heads import views

    assert tuple(views._TRANSFORMS) == AUGMENTATIONS
