"""Commands on a model already in the store default to the store's own model: its only one, or, of several, the
one `serving` points at; several and no serving alias is refused in one line; an explicit --model always wins."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from imgest.cli import app
from imgest.state.aliases import read_alias
from imgest.state.models import list_models
from imgest.storage import open_location
from tests.helpers import gradient, png_bytes, write_files

pytestmark = pytest.mark.usefixtures("prefect_harness")
SMALL, LARGE = "raw-pixels-4", "raw-pixels-8"  # 48 and 192 dimensions: cheap real encoders


def _imgest(*args: str):
    return CliRunner().invoke(app, list(args))


def _json(*args: str) -> dict:
    result = _imgest(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)  # stderr apart: Prefect's log lines


def _ingest(cat, store, *model: str) -> dict:
    return _json("ingest", "--catalogue", str(cat), "--store", str(store), *model, "--batch-size", "4")


def _build(store, *args: str) -> dict:
    return _json("build-index", "--store", str(store), *args)


def _slugs(store) -> dict[str, str]:
    return {m["name"]: m["slug"] for m in list_models(open_location(str(store)))}


def _catalogue(root):
    write_files(str(root), {f"p/{i:02d}.png": png_bytes(gradient(i, (32, 32))) for i in range(12)})
    return root


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """A store holding raw-pixels-4 and raw-pixels-8, no index and no alias; tests that write copy it."""
    root = tmp_path_factory.mktemp("two-models")
    cat, store = _catalogue(root / "catalogue"), root / "store"
    _ingest(cat, store, "--model", SMALL)
    _ingest(cat, store, "--model", LARGE)
    assert set(_slugs(store)) == {SMALL, LARGE}
    return {"catalogue": cat, "store": store}


def _copy(two_models, tmp_path):
    shutil.copytree(two_models["store"], tmp_path / "store")
    return tmp_path / "store"


def test_the_one_model_a_store_holds_is_every_later_commands_model(tmp_path):
    cat, store = _catalogue(tmp_path / "catalogue"), tmp_path / "store"
    first = _ingest(cat, store, "--model", SMALL)
    assert first["slug"].startswith(f"{SMALL}-") and first["encoded"] == 12
    card = _build(store)  # no --model: the store's only model, not efficientnet-lite0
    assert (card["slug"], card["n"], card["d"]) == (first["slug"], 12, 48)
    again = _ingest(cat, store)  # an ingest into it keeps to its model: nothing new to encode
    assert (again["slug"], again["encoded"]) == (first["slug"], 0)
    exported = _imgest("export", "--store", str(store), "--out", str(tmp_path / "rows.parquet"))
    assert exported.exit_code == 0 and f"exported 12 live embeddings of {first['model_id']}" in exported.stdout


def test_of_several_models_the_one_serving_points_at(two_models, tmp_path):
    store, slugs = _copy(two_models, tmp_path), _slugs(two_models["store"])
    built = _build(store, "--model", LARGE)  # the store's first alias: serving on raw-pixels-8
    assert read_alias(open_location(str(store)), "serving")["slug"] == built["slug"] == slugs[LARGE]
    again = _build(store)  # no --model: serving's model (nothing changed: that version, reused)
    assert (again["slug"], again["version"]) == (slugs[LARGE], built["version"])
    assert _ingest(two_models["catalogue"], store)["slug"] == slugs[LARGE]


def test_several_models_and_no_serving_alias_are_refused_in_one_line(two_models, tmp_path):
    store, slugs = two_models["store"], _slugs(two_models["store"])
    have = f"{SMALL} ({slugs[SMALL]}), {LARGE} ({slugs[LARGE]})"
    said = f"imgest: error: store {open_location(str(store)).url} holds 2 models and no serving alias: pass {{}} " \
           f"with one of {have}"
    commands = {"--model": [["build-index", "--store", str(store)],
                            ["ingest", "--catalogue", str(two_models["catalogue"]), "--store", str(store)],
                            ["export", "--store", str(store), "--out", str(tmp_path / "rows.parquet")]],
                "--base-model": [["train-head", "--store", str(store), "--whiten"]]}
    for flag, runs in commands.items():
        for args in runs:
            refused = _imgest(*args)  # the whole reason on one line of its own, before any work
            assert refused.exit_code == 2 and said.format(flag) in refused.stderr.splitlines(), refused.output
    assert not (store / "indexes").exists() and not (tmp_path / "rows.parquet").exists()


def test_an_explicit_model_wins_over_serving(two_models, tmp_path):
    store, slugs = _copy(two_models, tmp_path), _slugs(two_models["store"])
    _build(store, "--model", LARGE)
    card = _build(store, "--model", SMALL)
    assert (card["slug"], card["d"]) == (slugs[SMALL], 48)
    assert read_alias(open_location(str(store)), "serving")["slug"] == slugs[LARGE]  # serving stays where it was
