"""A whitening head end to end: `train-head --whiten` on a store's live vectors, query and catalogue vectors
transformed alike, the head through a migration window (promote, rollback), a nightly deriving its rows for
new items, and the refusals: labels given, a head as the base, a dimension above the base's, too few items, a
foreign matrix file."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from imgest import encoders
from imgest.cli import app
from imgest.config import MigrateConfig, NightlyConfig
from imgest.flows.migrate import migrate
from imgest.flows.nightly import nightly
from imgest.state.aliases import read_alias
from imgest.state.export import export_live
from imgest.storage import Location
from tests.helpers import gradient, png_bytes, write_files

pytestmark = pytest.mark.usefixtures("prefect_harness")


def _whiten(store, *args) -> tuple[int, str]:
    out = CliRunner().invoke(app, ["train-head", "--store", str(store), "--whiten", *args, "--json"])
    return out.exit_code, out.output


def test_a_whitening_head_through_the_window_and_the_nightly(tmp_path, tiny_models):
    cat, store = tmp_path / "catalogue", tmp_path / "store"
    write_files(str(cat), {f"p/{i:03d}.png": png_bytes(gradient(i, (48, 48))) for i in range(48)})
    base = f"hf:{tiny_models['dinov2']}"  # 32 dimensions: 48 items are enough to fit on
    night = nightly(NightlyConfig(catalogue=str(cat), store=str(store), model=base, batch_size="8", runtime="torch",
                                  precision="fp32"))  # stored rows are compared with a torch fp32 query below
    code, output = _whiten(store, "--base-model", base, "--dim", "16")
    assert code == 0, output
    saved = json.loads(output[output.index("{"):])
    record = saved["config"]
    assert (record["head_type"], record["dim_in"], record["dim_out"], record["sample"]) == ("whiten", 32, 16, 48)
    assert 0 < record["explained_variance"] <= 1 and record["base_model_id"] == night["ingest"]["model_id"]
    # by default learned from pairs: held-out images' views measure the proxy, named as one
    assert (record["method"], record["shrinkage"], record["shrinkage_source"], record["views"]) == \
        ("pairs", 0.5, "given", 3)
    proxy = record["proxy"]
    assert record["pairs"] == record["pair_images"] * 3 and record["pair_images"] + proxy["held_out_items"] == 48
    assert "a proxy" in proxy["what"] and 0 <= proxy["base"] <= 1 and 0 <= proxy["whitened"] <= 1
    assert record["base_model_id"] == night["ingest"]["model_id"]

    # catalogue rows are derived from the stored base vectors; a query image goes base -> head: the same map
    start = migrate(MigrateConfig(store=str(store), action="start", to=saved["head"], batch_size="8"))
    slug = start["window"]["to"]["slug"]
    assert start["coverage"]["share"] == 1.0 and read_alias(Location(str(store)), "shadow")["slug"] == slug
    export_live(str(store), slug, str(tmp_path / "rows.parquet"))
    import pyarrow.parquet as pq

    rows = pq.read_table(tmp_path / "rows.parquet").to_pydict()
    stored = dict(zip(rows["item_id"], rows["embedding"]))
    head = encoders.load(encoders.resolve(saved["head"]), "cpu")
    from imgest.images.decode import decode_image

    query = head.encode_images(np.stack([head.preprocess(decode_image((cat / "p" / "007.png").read_bytes()))]))[0]
    assert query.shape == (16,) and float(query @ np.asarray(stored["p/007.png"])) > 0.9999

    forced = CliRunner().invoke(app, ["migrate", "promote", "--store", str(store), "--force", "tested elsewhere"])
    assert forced.exit_code == 0, forced.output
    assert read_alias(Location(str(store)), "serving")["slug"] == slug
    rolled = migrate(MigrateConfig(store=str(store), action="rollback"))
    assert rolled["aliases"]["serving"]["slug"] == night["ingest"]["slug"]

    # new images: the nightly encodes them once with the base and derives the head's rows from there
    write_files(str(cat), {f"new/{i}.png": png_bytes(gradient(100 + i, (48, 48))) for i in range(3)})
    again = nightly(NightlyConfig(catalogue=str(cat), store=str(store), batch_size="8"))
    head_run = next(run["ingest"] for run in again["models"] if run["ingest"]["slug"] == slug)
    assert head_run["new"] == 3 and head_run["encoded"] == head_run["derived"] == 3

    # refusals, each one line and nothing written
    labels = tmp_path / "labels.csv"
    labels.write_text("item_id,label\np/000.png,a\n")
    for args, reason in ((["--base-model", base, "--labels", str(labels)], "give no --labels"),
                         (["--base-model", slug], "is itself a head"),
                         (["--base-model", base, "--dim", "64"], "--dim 64 is above the base model's 32"),
                         (["--base-model", base, "--sample", "20"], "needs more than 32 items to fit on; got 20"),
                         (["--base-model", base, "--shrinkage", "2"], "shrinkage must be auto or a number")):
        code, output = _whiten(store, *args)
        assert code == 2 and reason in output, (args, output)


def test_a_foreign_matrix_file_is_refused_on_load(tmp_path, tiny_models):
    import torch
    from safetensors.torch import save

    cat, store = tmp_path / "catalogue", tmp_path / "store"
    write_files(str(cat), {f"p/{i:03d}.png": png_bytes(gradient(i, (48, 48))) for i in range(40)})
    base = f"hf:{tiny_models['dinov2']}"
    nightly(NightlyConfig(catalogue=str(cat), store=str(store), model=base, batch_size="8"))
    code, output = _whiten(store, "--base-model", base, "--shrinkage", "auto", "--pair-images", "0")
    assert code == 0, output
    saved = json.loads(output[output.index("{"):])  # from the live vectors alone: Ledoit-Wolf, no image read
    assert (saved["config"]["method"], saved["config"]["shrinkage_source"]) == ("pca", "ledoit-wolf")
    assert "pair_images" not in saved["config"]
    folder = tmp_path / "store" / "heads" / saved["head_id"]
    for tensors, reason in (({"weight": torch.zeros(32, 32)}, "not a whitening's mean and projection"),
                            ({"mean": torch.zeros(32, dtype=torch.float64), "projection": torch.zeros(32, 32)},
                             "mean is float64")):
        weights = save(tensors)
        (folder / "head.safetensors").write_bytes(weights)  # its record made to match: only the checks remain
        config = json.loads((folder / "head.json").read_text())
        (folder / "head.json").write_text(json.dumps({**config, "weights_sha256": hashlib.sha256(weights).hexdigest()}))
        encoders.resolve.cache_clear()
        with pytest.raises(encoders.EncoderError, match=reason):
            encoders.load(encoders.resolve(saved["head"]), "cpu")


def test_a_window_to_a_whitening_head_derives_every_row_without_torch(tmp_path, tiny_models):
    """A cold start to a head fitted on stored vectors reads no image, so it needs neither the base model nor
    torch (~180 MB of a flow process that a model change at catalogue size keeps under a bound)."""
    import os
    import subprocess
    import sys

    from prefect.settings import PREFECT_API_URL

    cat, store = tmp_path / "catalogue", tmp_path / "store"
    write_files(str(cat), {f"p/{i:03d}.png": png_bytes(gradient(i, (48, 48))) for i in range(40)})
    base = f"hf:{tiny_models['dinov2']}"
    nightly(NightlyConfig(catalogue=str(cat), store=str(store), model=base, batch_size="8"))
    code, output = _whiten(store, "--base-model", base, "--pair-images", "0")
    assert code == 0, output
    head = json.loads(output[output.index("{"):])["head"]
    script = ("import sys; from imgest.config import MigrateConfig; from imgest.flows.migrate import migrate; "
              f"done = migrate(MigrateConfig(store={str(store)!r}, action='start', to={head!r})); "
              "print(done['coverage']['share'], 'torch' in sys.modules, 'transformers' in sys.modules)")
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()})
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.split()[-3:] == ["1.0", "False", "False"], ran.stdout[-500:]
