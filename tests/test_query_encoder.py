"""Queries are encoded as the catalogue was: the runtime and precision a version's card says made its vectors."""

import json
import logging

import numpy as np
import pytest
from typer.testing import CliRunner

from imgest.cli import app
from imgest.config import IndexConfig
from imgest.encoders import precision, runtimes
from imgest.retrieval.query import Searcher, catalogue_encoding, query_encoder
from tests.helpers import ingest_into, small_catalogue, write_files


def test_the_catalogues_encoding_is_the_majority_of_the_cards_rows_and_never_anything_else():
    card = {"encoded_by": {"openvino fp32": 900, "torch bf16": 100, "unrecorded": 5000}}
    assert catalogue_encoding(card) == ("openvino", "fp32")  # shards that did not record it say nothing
    assert catalogue_encoding({"encoded_by": {"torch bf16": 3, "openvino fp32": 2}}) == ("torch", "bf16")
    for hostile in ({"evil fp32": 10}, {"openvino fp64": 10}, {"auto auto": 10}, {"openvino fp32": "10"},
                    {"openvino fp32": True}, {"openvino fp32": -1}, {"openvino  fp32": 10}, ["openvino fp32"],
                    {"s3://bucket/model fp32": 10}):
        assert catalogue_encoding({"encoded_by": hostile}) is None, hostile
    assert catalogue_encoding({}) is None  # a version built before the card counted it


@pytest.mark.slow("real weights")
def test_a_runtime_that_cannot_run_here_falls_back_to_the_plain_encoder_with_one_warning(monkeypatch, caplog):
    from imgest import encoders

    spec = encoders.resolve("efficientnet-lite0")
    monkeypatch.setattr(encoders, "_loaded", {})  # nothing this process compiled before
    monkeypatch.setattr(runtimes.OpenVINORuntime, "missing", lambda self: "the openvino package is not installed")
    with caplog.at_level(logging.WARNING, logger="imgest"):
        encoder = query_encoder(spec, "cpu", {"slug": "m", "version": 3, "encoded_by": {"openvino fp32": 7}})
    assert (encoder.runtime, encoder.precision) == ("torch", "fp32")
    warned = [r.getMessage() for r in caplog.records if "queries of model=m v3" in r.getMessage()]
    assert len(warned) == 1 and "encoded with openvino fp32, which cannot run here" in warned[0]


@pytest.mark.skipif("bf16" not in precision.native_precisions("cpu"), reason="this CPU has no native bf16")
def test_a_bf16_catalogue_is_searched_with_bf16_queries(prefect_harness, tmp_path):
    """A catalogue encoded in torch bf16 (it passes the parity gate with Lite0 here): a query that is one of its
    images gets that image's stored vector back (score 1 to rounding), which an fp32 query would not; the
    answer says what encoded the query."""
    from imgest import encoders
    from imgest.flows.build_index import build_index

    cat, store = tmp_path / "catalogue", tmp_path / "store"
    files = small_catalogue(12)
    write_files(str(cat), files)
    ingest_into(cat, store, runtime="torch", precision="bf16", batch_size="4")
    build_index(IndexConfig(store=str(store), alias="serving"))
    searcher = Searcher(str(store), device="cpu")
    assert searcher.card["encoded_by"] == {"torch bf16": 12}
    asked = cat / "img" / "0005.jpg"
    result = CliRunner().invoke(app, ["search", "--store", str(store), "--image", str(asked), "--k", "3", "--json",
                                      "--device", "cpu"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert answer["query_encoded_by"] == "torch bf16"
    top = answer["results"][0]["hits"][0]
    assert top["item_id"] == "img/0005.jpg" and top["score"] >= 0.99999
    plain = encoders.load(searcher.spec, "cpu")  # torch fp32: what queries were encoded with before
    stored = searcher.stored_vector("img/0005.jpg")
    fp32 = plain.encode_images(np.stack([plain.preprocess(_decoded(asked, plain))]))[0]
    assert float(fp32 @ stored) < 0.9999 < top["score"]


def _decoded(path, encoder):
    from imgest.images.decode import decode_image

    return decode_image(path.read_bytes(), min_side=encoder.decode_side)
