"""Metric-learning heads: the losses, the mining, the head as a model (id, derived shards, migration)."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from imgest.config import EvalConfig, HeadConfig, MigrateConfig, NightlyConfig, TrainHeadConfig
from imgest.config.flow_params import gather_flat
from imgest.tasks.heads import labels as label_files
from imgest.tasks.heads.labels import read_label_table, read_labels, stage_labels
from imgest.tasks.heads.train import HeadError, infonce, proxynca, train_head, triplet_semihard
from imgest.tasks.heads.views import AUGMENTATIONS
from tests.helpers import ingest_into

# -- losses, no Prefect needed --------------------------------------------------------------------------


def _circle(*degrees: float) -> torch.Tensor:
    return torch.tensor([[math.cos(math.radians(a)), math.sin(math.radians(a))] for a in degrees])


def test_semihard_mining_on_a_hand_worked_batch():
    # Unit vectors at 0 and 60 degrees (label 0), 90 and 200 degrees (label 1); d = 2 - 2 cos(angle).
    e, labels, margin = _circle(0, 60, 90, 200), torch.tensor([0, 0, 1, 1]), 1.5

    def d(a, b):
        return 2 - 2 * math.cos(math.radians(a - b))

    expected = [
        # anchor 0: positive 60 (d=1.0); negatives 90 (2.0, semi-hard: 1.0 < 2.0 < 2.5) and 200 (3.88)
        d(0, 60) - d(0, 90) + margin,
        # anchor 60: positive 0 (1.0); negatives 90 (0.27) and 200 (3.53): none in (1.0, 2.5): hardest, 90
        d(60, 0) - d(60, 90) + margin,
        # anchor 90: positive 200 (2.68); negatives 0 (2.0), 60 (0.27): none farther than 2.68: hardest, 60
        d(90, 200) - d(90, 60) + margin,
        # anchor 200: positive 90 (2.68); negatives 0 (3.88) and 60 (3.53) both semi-hard: the harder, 60
        d(200, 90) - d(200, 60) + margin,
    ]
    assert float(triplet_semihard(e, labels, margin)) == pytest.approx(np.mean(expected), abs=1e-5)
    # With a margin no negative fits in, every anchor falls back to its hardest negative.
    assert float(triplet_semihard(e, labels, 0.0)) == pytest.approx(
        np.mean([max(0, d(0, 60) - d(0, 90)), max(0, d(60, 0) - d(60, 90)), max(0, d(90, 200) - d(90, 60)),
                 max(0, d(200, 90) - d(200, 60))]), abs=1e-5)


def test_infonce_and_proxynca_match_their_formulas():
    e, labels = _circle(0, 60, 90, 200), torch.tensor([0, 0, 1, 1])
    sims = (e @ e.T).numpy() / 0.5
    expected = []
    for i in range(4):
        others = [j for j in range(4) if j != i]
        positive = next(j for j in others if labels[j] == labels[i])
        expected.append(-(sims[i, positive] - np.log(np.exp(sims[i, others]).sum())))
    assert float(infonce(e, labels, temperature=0.5)) == pytest.approx(np.mean(expected), abs=1e-5)

    proxies = _circle(30, 145)  # one per label, already unit length
    d = 2 * (2 - 2 * (e @ proxies.T).numpy())  # scale 2
    # ProxyNCA: -log(exp(-d(x, own)) / sum over the *other* proxies of exp(-d)); one other proxy here
    expected = [d[i, labels[i]] - d[i, 1 - labels[i]] for i in range(4)]
    assert float(proxynca(e, labels, proxies, scale=2.0)) == pytest.approx(np.mean(expected), abs=1e-5)


def _toy(seed=0, labels=8, per_label=12, d=16):
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((labels, d))
    x = np.repeat(centres, per_label, axis=0) + 1.2 * rng.standard_normal((labels * per_label, d))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    names = [f"l{i}" for i in range(labels) for _ in range(per_label)]
    return x.astype(np.float32), [f"item-{i}" for i in range(len(names))], names


@pytest.mark.parametrize("loss", ["triplet", "infonce", "proxynca"])
def test_each_loss_decreases_on_a_toy_problem(loss):
    x, ids, labels = _toy()
    cfg = HeadConfig(loss=loss, head_type="mlp", dim_out=8, hidden=32, epochs=15, labels_per_batch=8,
                     items_per_label=4, lr=3e-3, patience=15, seed=0, keep=0.0)
    result = train_head(x, ids, labels, cfg)
    curve = [h["train_loss"] for h in result.history]
    assert len(curve) == 15 and np.mean(curve[-3:]) < 0.7 * np.mean(curve[:3]), curve
    assert result.best_epoch >= 1 and result.history[result.best_epoch - 1]["val_recall@1"] == result.val_recall_at_1
    # seeded: the same inputs give the same weights
    again = train_head(x, ids, labels, cfg)
    assert all(torch.equal(result.state_dict[k], again.state_dict[k]) for k in result.state_dict)


def test_a_residual_head_starts_as_the_base_and_is_kept_only_if_an_epoch_beats_it():
    from imgest.encoders.head import load_state, project

    x, ids, labels = _toy()
    frozen = train_head(x, ids, labels, HeadConfig(hidden=32, epochs=3, labels_per_batch=8, lr=0.0, patience=3))
    assert [h["epoch"] for h in frozen.history] == [0, 1, 2, 3] and frozen.best_epoch == 0
    assert frozen.history[0]["val_recall@1"] == frozen.base_val_recall_at_1, "epoch 0 is the base itself"
    np.testing.assert_allclose(project(load_state(frozen), x), x, atol=1e-6)  # nothing beat it: the identity
    # labels in 4 of 16 dimensions, noise in the rest: a head that learns to ignore the noise beats the base
    rng = np.random.default_rng(0)
    centres = np.zeros((8, 16))
    centres[:, :4] = rng.standard_normal((8, 4))
    noisy = np.repeat(centres, 12, 0) + np.hstack([0.3 * rng.standard_normal((96, 4)), rng.standard_normal((96, 12))])
    noisy = (noisy / np.linalg.norm(noisy, axis=1, keepdims=True)).astype(np.float32)
    trained = train_head(noisy, ids, labels, HeadConfig(hidden=32, epochs=10, labels_per_batch=8, lr=1e-2,
                                                        patience=10))
    assert trained.best_epoch >= 1 and trained.val_recall_at_1 > trained.base_val_recall_at_1
    with pytest.raises(ValueError, match="a residual head keeps the base dimension 16"):
        train_head(x, ids, labels, HeadConfig(dim_out=8))


def test_hard_negatives_share_a_batch_and_the_keep_term_is_zero_only_at_the_base():
    from imgest.tasks.heads.train import keep_neighbourhood, neighbour_labels, pk_batches

    x, ids, labels = _toy(labels=12, per_label=4)
    label_ids = np.array([int(name[1:]) for name in labels])
    rows = np.arange(len(x))
    near = neighbour_labels(x, label_ids, rows, 2)
    centroids = np.stack([x[label_ids == lab].mean(0) for lab in range(12)])
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    sims = centroids @ centroids.T
    np.fill_diagonal(sims, -np.inf)
    assert near[0].tolist() == np.argsort(-sims[0])[:2].tolist(), "the two labels nearest in base space"
    cfg = HeadConfig(labels_per_batch=3, items_per_label=2, hard_negatives=2)
    first = set(label_ids[pk_batches(rows, label_ids, cfg, np.random.default_rng(0), near)[0]].tolist())
    assert any(first == {lab, *near[lab]} for lab in first), "the first batch: a label and its two neighbours"
    base = torch.nn.functional.normalize(torch.from_numpy(x[:16]), dim=1)
    assert float(keep_neighbourhood(base, base, 0.05)) == pytest.approx(0.0, abs=1e-6)
    noise = torch.randn(base.shape, generator=torch.Generator().manual_seed(0))
    moved = torch.nn.functional.normalize(base + 0.5 * noise, dim=1)
    assert float(keep_neighbourhood(moved, base, 0.05)) > 0.01


def test_bad_labels_and_parameters_are_refused_clearly(tmp_path):
    with pytest.raises(HeadError, match="header `item_id,label`"):
        read_labels(b"id,class\na,b\n", "labels.csv")
    assert read_labels(b'{"item_id": "a.jpg", "label": "x"}\n', "l.jsonl") == {"a.jpg": "x"}
    # read as columns: each item once, its last row winning, in item_id order (a number read as an id's text)
    table = read_label_table(b"\xef\xbb\xbfitem_id,label,note\nb.jpg,y,1\na.jpg,x,2\nb.jpg,z,3\n", "l.csv")
    assert table.to_pydict() == {"item_id": ["a.jpg", "b.jpg"], "label": ["x", "z"]}
    assert read_label_table(b'{"item_id": 7, "label": "x"}\n\n{"item_id": "a", "label": "y"}\n',
                            "l.jsonl").to_pydict() == {"item_id": ["7", "a"], "label": ["x", "y"]}
    # every malformed file is refused as the row reader refuses it: by its line or row
    for data, name, message in (
            (b'{"item_id": "a", "label": "x"}\nnot json\n', "l.jsonl", "l.jsonl line 2: not JSON"),
            (b'{"item_id": "a", "label": "x"}\n\n{"item_id": "b"}\n', "l.jsonl", "l.jsonl row 2: item_id and label"),
            (b"item_id,label\na,x\nb\n", "l.csv", "l.csv row 2: item_id and label are both required"),
            (b"item_id,label\na,x\n,y\n", "l.csv", "l.csv row 2: item_id and label are both required"),
            (b"id,class\na,b\n", "l.csv", r"l.csv: a labels CSV needs the header `item_id,label`; got \['id'"),
            (b"", "l.csv", "got None")):
        with pytest.raises(HeadError, match=message):
            read_label_table(data, name)
        (tmp_path / name).write_bytes(data)  # and as train-head reads a file: streamed, with the same error
        with pytest.raises(HeadError, match=message):
            stage_labels(str(tmp_path / name), str(tmp_path / "scratch"))
    with pytest.raises(HeadError, match="missing.csv does not exist"):
        stage_labels(str(tmp_path / "missing.csv"), str(tmp_path / "scratch"))
    with pytest.raises(ValueError, match="loss must be one of triplet, infonce, proxynca"):
        HeadConfig(loss="arcface")
    x, ids, _ = _toy(labels=2, per_label=2)
    with pytest.raises(HeadError, match="at least 2"):
        train_head(x, ids, ["a", "b", "c", "d"], HeadConfig(epochs=1))


def _staged(path, folder) -> dict:
    import duckdb

    staged = stage_labels(str(path), str(folder))
    rows = duckdb.sql(f"SELECT * FROM {staged.relation()} ORDER BY item_id").fetchall()
    return {"ordered": staged.ordered, "rows": staged.rows, "labels": dict(rows)}


@pytest.mark.parametrize("suffix", ["csv", "jsonl"])
def test_a_label_file_is_streamed_a_block_at_a_time_its_last_row_winning_and_bad_rows_named(
        tmp_path, monkeypatch, suffix):
    monkeypatch.setattr(label_files, "LABEL_BLOCK_BYTES", 256)  # a few rows a block: 3,000 rows are many blocks

    def write(name, rows):
        path = tmp_path / f"{name}.{suffix}"
        if suffix == "csv":
            path.write_text("item_id,label\n" + "".join(f"{i},{lab}\n" for i, lab in rows))
        else:
            path.write_text("".join(json.dumps({"item_id": i, "label": lab}) + "\n" for i, lab in rows))
        return path

    rows = [(f"sku-{n:05d}", f"c{n % 7}") for n in range(3_000)]
    got = _staged(write("sorted", rows), tmp_path / "a")
    assert got == {"ordered": True, "rows": 3_000, "labels": dict(rows)}, "a sorted file: no pass to find duplicates"
    shuffled = [rows[n] for n in np.random.default_rng(0).permutation(3_000)]
    again = shuffled + [("sku-00002", "late"), (shuffled[0][0], "later")]  # corrected in the file's last block
    got = _staged(write("shuffled", again), tmp_path / "b")
    assert not got["ordered"] and got["rows"] == 3_002
    assert got["labels"] == dict(rows) | {"sku-00002": "late", shuffled[0][0]: "later"}, "each item's last row wins"
    blank = rows[:2_500] + [("sku-99999", "")] + rows[2_500:]
    with pytest.raises(HeadError, match=rf"blank.{suffix} row 2501: item_id and label are both required"):
        stage_labels(str(write("blank", blank)), str(tmp_path / "c"))


# -- the head as a model, through Prefect -------------------------------------------------------------


@pytest.fixture(scope="module")
def labelled(tmp_path_factory, prefect_harness):
    from tests.helpers import gradient, png_bytes, write_files

    root = tmp_path_factory.mktemp("heads")
    cat, store = root / "catalogue", root / "store"
    # 6 labels x 6 images: each label a colour family (same base pattern, different noise)
    files, rows = {}, ["item_id,label"]
    for label in range(6):
        for n in range(6):
            base = np.asarray(gradient(label, (48, 48)), np.float32)
            noise = np.random.default_rng(100 * label + n).normal(0, 40, base.shape)
            from PIL import Image

            image = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))
            key = f"l{label}/{n}.png"
            files[key] = png_bytes(image)
            rows.append(f"{key},label-{label}")
    write_files(str(cat), files)
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    # torch fp32: derived shards (the head over these vectors) are compared with the head over a fresh fp32 decode,
    # and the views of label-free heads are encoded on what the shards record: torch fp32, nothing compiled
    ingest_into(cat, store, batch_size="8", shard_size=10, runtime="torch", precision="fp32")
    return root


def _train(root, **kw):
    from imgest.flows.train_head import train_head_flow

    args = {"store": str(root / "store"), "base_model": "efficientnet-lite0", "labels": str(root / "labels.csv"),
            "loss": "infonce", "head_type": "mlp", "dim_out": 16, "hidden": 64, "epochs": 4, "labels_per_batch": 6,
            "items_per_label": 2, "patience": 4} | kw
    return train_head_flow(TrainHeadConfig.model_validate(gather_flat(TrainHeadConfig, args)[0]["config"]))


def test_a_store_that_takes_no_writes_is_refused_before_training(labelled, tmp_path):
    import shutil

    from imgest.storage import StorageError

    store = tmp_path / "store"
    shutil.copytree(labelled / "store", store, ignore=shutil.ignore_patterns("heads"))
    (store / "heads").write_text("a file where the heads folder goes")  # as root, a file stops writes as chmod can't
    with pytest.raises(StorageError, match="does not take writes under heads/"):
        _train(labelled, store=str(store))


def test_head_model_id_follows_the_weights(labelled):
    from imgest import encoders

    first, same, other = _train(labelled), _train(labelled), _train(labelled, seed=1)
    spec = encoders.resolve(first["head"])
    base = encoders.resolve("efficientnet-lite0")
    assert spec.model_id == f"{base.model_id}+head-{first['config']['weights_sha256'][:16]}"
    assert first["head"] == same["head"], "same labels, same seed: the same head"
    assert encoders.resolve(other["head"]).model_id != spec.model_id, "other weights, another model id"
    assert spec.dim == 16 and spec.slug != base.slug
    queries = [line for line in open(first["queries"].removeprefix("file://")) if line.strip()]
    assert len(queries) == first["config"]["counts"]["val_items"] > 0


def test_head_weights_are_checked_against_their_hash_at_resolve_and_at_load(labelled, tmp_path):
    import shutil

    from imgest import encoders
    from imgest.encoders.base import EncoderError
    from imgest.encoders.head import load_module

    first, other = _train(labelled), _train(labelled, seed=1)
    folder = tmp_path / "head"
    shutil.copytree(first["folder"].removeprefix("file://"), folder)
    spec = encoders.resolve(f"head:{folder}")
    load_module(str(folder), spec.extra["config"], sha256=spec.revision)  # the weights it was resolved with
    shutil.copy(os.path.join(other["folder"].removeprefix("file://"), "head.safetensors"), folder / "head.safetensors")
    with pytest.raises(EncoderError, match="changed since it was resolved"):
        load_module(str(folder), spec.extra["config"], sha256=spec.revision)
    encoders.resolve.cache_clear()
    with pytest.raises(EncoderError, match="refusing a head whose weights were replaced"):
        encoders.resolve(f"head:{folder}")


def test_derived_shards_equal_base_then_head_on_the_same_images(labelled, tmp_path, monkeypatch):
    from imgest.state.export import export_live
    from imgest.storage import Location

    head = _train(labelled)["head"]
    cat = labelled / "catalogue"
    derived = ingest_into(cat, labelled / "store", model=head, batch_size="8", shard_size=10)
    assert derived["derived"] == derived["encoded"] == 36 and derived["batch_size_source"].startswith("every item")
    monkeypatch.setenv("IMGEST_MODEL_DIRS", str(labelled / "store" / "heads"))  # a head trained in another store
    decoded = ingest_into(cat, tmp_path / "fresh", model=head, batch_size="8", shard_size=10, runtime="torch",
                          precision="fp32")  # as the base was
    assert decoded["derived"] == 0 and decoded["encoded"] == 36, "no base embeddings there: base then head"

    def vectors(store, out):
        slug = derived["slug"]
        export_live(str(store), slug, str(out))
        table = pq.read_table(out).sort_by("item_id")
        return table.column("item_id").to_pylist(), np.stack(table.column("embedding").to_numpy(zero_copy_only=False))

    (ids_a, a), (ids_b, b) = vectors(labelled / "store", tmp_path / "a.parquet"), vectors(tmp_path / "fresh",
                                                                                        tmp_path / "b.parquet")
    assert ids_a == ids_b
    np.testing.assert_allclose(a, b, atol=1e-5)
    assert Location(str(labelled / "store")).exists(f"state/model={derived['slug']}/model.json")


def test_head_goes_through_the_migration_window(labelled):
    from imgest.flows.migrate import migrate
    from imgest.flows.nightly import nightly
    from imgest.state.aliases import read_alias
    from imgest.storage import Location

    store = str(labelled / "store")
    nightly(NightlyConfig(catalogue=str(labelled / "catalogue"), store=store, batch_size="8"))
    base_slug = read_alias(Location(store), "serving")["slug"]
    trained = _train(labelled, loss="proxynca")
    started = migrate(MigrateConfig(store=store, action="start", to=trained["head"]))
    assert started["coverage"]["share"] == 1.0
    # base (serving) against head (shadow) on the head's held-out split: win/loss and a bootstrap interval
    from imgest.flows.evaluate import evaluate

    report = evaluate(EvalConfig(store=store, queries=trained["queries"], alias="serving", compare="shadow", ks=[1, 5],
                                 resamples=200))
    assert report["queries"] == trained["config"]["counts"]["val_items"]
    assert set(report["compare"]) >= {"win_loss", "bootstrap"}, sorted(report["compare"])
    migrate(MigrateConfig(store=store, action="promote"))
    serving = read_alias(Location(store), "serving")
    assert serving["model_id"].startswith("efficientnet-lite0@") and "+head-" in serving["model_id"]
    migrate(MigrateConfig(store=store, action="rollback"))
    assert read_alias(Location(store), "serving")["slug"] == base_slug

    # Promoted again and finished with no retention: the base model is retired but kept, because the
    # serving head is built on its embeddings.
    migrate(MigrateConfig(store=store, action="promote"))
    finished = migrate(MigrateConfig(store=store, action="finish", retain_days=0))["finished"]
    assert finished["window"]["retired"]["slug"] == base_slug and base_slug not in finished["deleted"]
    assert Location(store).exists(f"state/model={base_slug}/model.json")
    # a 16-d head serves this store now: train-head's default base is that head's base, never the head
    from typer.testing import CliRunner

    from imgest.cli import app

    wide = CliRunner().invoke(app, ["train-head", "--store", store, "--dim", "16"])
    assert wide.exit_code == 2 and "a residual head keeps the base dimension" in wide.output


def test_nightly_on_a_head_keeps_its_base_current_and_decodes_new_images_once(labelled, tmp_path, monkeypatch):
    import shutil

    from imgest.flows.nightly import nightly
    from tests.helpers import gradient, png_bytes, write_files

    cat, store = tmp_path / "catalogue", tmp_path / "store"
    shutil.copytree(labelled / "catalogue", cat)  # copy2: same mtimes, so the 36 images are unchanged
    shutil.copytree(labelled / "store", store)
    head = _train(labelled)["head"]  # trained in the original store: listed, as an operator lists it
    monkeypatch.setenv("IMGEST_MODEL_DIRS", str(labelled / "store" / "heads"))
    write_files(str(cat), {f"new/{n}.png": png_bytes(gradient(40 + n, (48, 48))) for n in range(4)})

    run = nightly(NightlyConfig(catalogue=str(cat), store=str(store), model=head, batch_size="8", shard_size=10))
    (base,) = run["bases"]
    assert base["model_id"] == run["ingest"]["model_id"].split("+head-")[0]
    assert base["new"] == base["encoded"] == 4 and base["unchanged"] >= 36, "the base model encoded the new images"
    # Every row the head encoded was derived from a base embedding: nothing decoded twice. (40 rows when the
    # head is new to the store, 4 when an earlier test in this module already ingested the same head.)
    head_run = run["ingest"]
    assert head_run["encoded"] == head_run["derived"] == head_run["listed"] - head_run["unchanged"] >= 4
    assert run["index"]["built"] and run["index"]["card"]["model_id"] == run["ingest"]["model_id"]


def test_without_labels_each_item_is_an_instance_with_augmented_views(labelled):
    import json

    from imgest.names import SELF_SUPERVISED_ITEMS
    from imgest.storage import read_url

    trained = _train(labelled, labels=None, views=2, loss="triplet")
    source = trained["config"]["labels"]
    assert source["file"] is None and source["augmented_views"] == 2 and source["items"] == 36
    assert source["max_items"] == SELF_SUPERVISED_ITEMS  # a sample by default (every item: --max-items 0)
    counts = trained["config"]["counts"]
    assert counts["labels"] == 36 and counts["train_items"] + counts["val_items"] == 36 * 3
    assert trained["config"]["training"]["split"] == "labels", "held-out items are unseen instances"
    queries = [json.loads(line) for line in read_url(trained["queries"]).decode().splitlines()]
    assert len(queries) == counts["val_items"] * 2 // 3, "two augmented views per held-out item"
    for q in queries:
        assert q["query_id"].startswith(q["relevant"][0] + "#view") and read_url(q["image"])[:4] == b"\x89PNG"
    validation = trained["config"]["validation"]
    assert validation["proxy"] is True and "views made by the training augmentations" in validation["measured_on"]
    assert "does not show robustness to a shift" in validation["note"]
    assert source["augmentations"] == list(AUGMENTATIONS) and "quantisation" in source["transforms"]
    from imgest.reports.heads import render_head

    assert "(**a proxy**)" in render_head(trained)


def test_eval_queries_select_the_epoch_and_report_base_against_head(labelled):
    """Real queries (here: catalogue images against the other items of their label) choose the epoch; the
    report and head.json say what was measured, with base vs head and the paired bootstrap interval."""
    import json

    from typer.testing import CliRunner

    from imgest.cli import app

    queries = labelled / "eval.jsonl"
    lines = [{"query_id": f"l{lab}/{n}", "image": str(labelled / "catalogue" / f"l{lab}" / f"{n}.png"),
              "exclude": [f"l{lab}/{n}.png"], "relevant": [f"l{lab}/{m}.png" for m in range(6) if m != n]}
             for lab in range(6) for n in (0, 1)] + [{"query_id": "gone", "image": str(labelled / "catalogue" /
                                                      "l0" / "0.png"), "relevant": ["not/in/store.png"]}]
    queries.write_text("".join(json.dumps(q) + "\n" for q in lines))
    trained = _train(labelled, head_type="residual", dim_out=0, epochs=3, eval_queries=str(queries), lr=3e-3)
    validation = trained["config"]["validation"]
    e = validation["eval"]
    assert e["file"] == str(queries) and e["queries"] == 12 and e["dropped_queries"] == 1
    assert validation["proxy"] is False and str(queries) in validation["measured_on"]
    history = validation["history"]
    assert history[0]["epoch"] == 0 and history[0]["eval_recall@1"] == e["base"]["recall@1"], "epoch 0 is the base"
    best = max(history, key=lambda h: (h["eval_recall@1"], h["eval_recall@10"]))
    assert validation["best_epoch"] == best["epoch"] and e["head"]["recall@1"] == best["eval_recall@1"]
    for metric in ("recall@1", "recall@10"):
        interval = e["bootstrap"][metric]
        assert interval["low"] <= interval["difference"] <= interval["high"]
        assert interval["difference"] == pytest.approx(e["head"][metric] - e["base"][metric], abs=1e-4)
    bad = CliRunner().invoke(app, ["train-head", "--store", str(labelled / "store"), "--augment", "crop,sepia"])
    assert bad.exit_code == 2 and "unknown augmentation 'sepia'" in bad.output


def test_encoded_views_are_cached_by_what_makes_them(labelled, tmp_path, monkeypatch):
    """A second head on the same catalogue reads the encoded views instead of decoding and encoding again;
    another augmentation set, or an item whose content changed, is encoded afresh."""
    from dataclasses import replace

    from imgest.state.live import load_live_vectors
    from imgest.state.models import find_model
    from imgest.storage import Location
    from imgest.tasks.heads.views import augmented_instances

    loc = Location(str(labelled / "store"))
    base = find_model(loc, "efficientnet-lite0")
    live = load_live_vectors(loc, base["slug"], int(base["dim"]))
    cache, lines = str(tmp_path / "views"), []
    first = augmented_instances(live, base["name"], 2, 0, max_items=8, cache_dir=cache, log=lines.append)
    again = augmented_instances(live, base["name"], 2, 0, max_items=8, cache_dir=cache, log=lines.append)
    assert len(os.listdir(cache)) == 1 and "read from the cache" in lines[-2] and "cache" not in lines[0]
    np.testing.assert_array_equal(first[0], again[0])
    assert first[1:] == again[1:]
    (cached,) = os.listdir(cache)
    with open(os.path.join(cache, cached), "wb") as fh:  # a damaged cache file is encoded again, never trusted
        fh.write(b"not an npz")
    repaired = augmented_instances(live, base["name"], 2, 0, max_items=8, cache_dir=cache, log=lines.append)
    np.testing.assert_allclose(repaired[0], first[0], atol=1e-5)
    assert "cache" not in lines[-2]
    path = os.path.join(cache, cached)
    whole = open(path, "rb").read()
    # truncated, and a header claiming another shape than these rows make: encoded again, never a failure
    for damaged in (whole[:len(whole) // 2], whole.replace(b"'shape': (16, ", b"'shape': (96, ", 1)):
        with open(path, "wb") as fh:
            fh.write(damaged)
        again = augmented_instances(live, base["name"], 2, 0, max_items=8, cache_dir=cache, log=lines.append)
        np.testing.assert_allclose(again[0], first[0], atol=1e-5)
        assert "cache" not in lines[-2]
    with monkeypatch.context() as patch:  # a cache that cannot be written (disk full): logged, training goes on
        patch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
        unwritten = augmented_instances(live, base["name"], 2, 0, max_items=8, cache_dir=cache,
                                        names=("crop", "rotate"), log=lines.append)
    assert "views not cached" in lines[-2] and len(unwritten[1]) == len(first[1])
    assert os.listdir(cache) == [cached], "no partial file is left behind"
    other = augmented_instances(live, base["name"], 2, 0, max_items=8, cache_dir=cache, names=("crop", "flip"))
    assert len(os.listdir(cache)) == 2 and not np.array_equal(other[0][8:], first[0][8:])
    hashes = list(live.content_hashes)
    hashes[first[3][0]] = "changed"  # one of the items used
    changed = replace(live, content_hashes=hashes)
    augmented_instances(changed, base["name"], 2, 0, max_items=8, cache_dir=cache)
    assert len(os.listdir(cache)) == 3


@pytest.mark.slow("a parity check of torch bf16 on the parity sample: 40 s on two cores")
def test_views_are_encoded_on_the_runtime_and_precision_the_shards_record(tiny_models, tmp_path):
    """An item's views are made as its stored vector was: the runtime and precision most of the rows read were
    encoded with (their shards' record), behind the parity check; the plain encoder, said in one line, where that
    cannot run here. The images made into views are reported as they go."""
    from imgest import encoders
    from imgest.encoders.precision import native_precisions
    from imgest.state.live import LiveVectors
    from imgest.storage import Location
    from imgest.tasks.heads.views import AUGMENTATIONS, _encode_views, augmented_instances, recorded_encoding
    from tests.helpers import gradient, png_bytes, write_files

    # the pair most rows name, among those a run could load ("unrecorded" and numpy's raw pixels are not)
    assert recorded_encoding({"torch bf16": 10, "torch fp32": 3, "unrecorded": 50, "numpy fp32": 99}) == \
        ("torch", "bf16")
    assert recorded_encoding({"unrecorded": 5}) is None and recorded_encoding(None) is None
    if "bf16" not in native_precisions("cpu"):
        pytest.skip("this CPU does not compute in bf16 natively: no reduced precision to record")
    name = f"hf:{tiny_models['dinov2']}"
    spec = encoders.resolve(name)
    cat = tmp_path / "catalogue"
    keys = [f"p/{i}.png" for i in range(4)]
    write_files(str(cat), {key: png_bytes(gradient(i, (48, 48))) for i, key in enumerate(keys)})
    (tmp_path / "store").mkdir()
    root = Location(str(cat)).uri().rstrip("/")

    def live(encoded_by: dict) -> LiveVectors:
        return LiveVectors(keys, [f"{root}/{k}" for k in keys], [f"h{i}" for i in range(4)],
                           np.eye(4, spec.dim, dtype=np.float32), 1, None, str(tmp_path / "store"), "tiny",
                           catalogue=str(cat), encoded_by=encoded_by)

    lines, seen = [], []
    made = augmented_instances(live({"torch bf16": 4}), name, 2, 0, device="cpu", cache_dir=None, log=lines.append,
                               progress=lambda done, total: seen.append((done, total)))
    assert lines[-1].endswith("on torch bf16") and seen[0] == (0, 4) and seen[-1] == (4, 4)
    rows = list(range(4))
    bf16 = _encode_views(live({}), rows, encoders.load(spec, "cpu", "torch", "bf16"), 2, 0, tuple(AUGMENTATIONS),
                         print)[1]
    fp32 = _encode_views(live({}), rows, encoders.load(spec, "cpu"), 2, 0, tuple(AUGMENTATIONS), print)[1]
    np.testing.assert_array_equal(made[0][4:], bf16)
    assert not np.array_equal(bf16, fp32) and np.min(np.sum(bf16 * fp32, axis=1)) > 0.98, "bf16, not fp32"
    if "fp16" not in native_precisions("cpu"):  # a precision this CPU lacks: the plain encoder, said once
        lines.clear()
        plain = augmented_instances(live({"torch fp16": 4}), name, 2, 0, device="cpu", cache_dir=None,
                                    log=lines.append)
        assert "encoded with torch fp16, which cannot run here" in lines[0] and lines[-1].endswith("on torch fp32")
        np.testing.assert_array_equal(plain[0][4:], fp32)
