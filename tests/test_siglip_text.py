"""SigLIP's text tower as transformers uses it: a SentencePiece tokenizer trained here (SiglipTokenizer, as the real
checkpoints ship), its texts padded to the trained length and embedded without an attention mask as transformers
documents SigLIP, and one line naming the fix when sentencepiece is missing."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from imgest import encoders
from imgest.encoders import EncoderError
from tests.helpers import ingest_into

TEXTS = ["red shoe", "A vintage Leather BACKPACK, in navy!", "a photo of a beige wool coat"]


def _unit(vectors) -> np.ndarray:
    vectors = np.asarray(vectors, np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def _documented(folder: str, texts, **tokenizer_kwargs) -> np.ndarray:
    """transformers' own usage of SigLIP (its model doc, SiglipModel.get_text_features' example): the processor
    with padding="max_length", everything it returns passed on to get_text_features."""
    import torch
    from transformers import AutoModel, AutoProcessor

    model, processor = AutoModel.from_pretrained(folder).eval(), AutoProcessor.from_pretrained(folder)
    inputs = processor(text=texts, padding="max_length", return_tensors="pt", **tokenizer_kwargs)
    with torch.no_grad():
        return _unit(model.get_text_features(**inputs).pooler_output)


def test_siglip_text_is_tokenized_and_embedded_as_transformers_documents(tiny_siglip_sentencepiece_folder):
    folder = tiny_siglip_sentencepiece_folder
    encoder = encoders.load(encoders.resolve(f"hf:{folder}"), "cpu")
    tokenizer = encoder.tokenizer
    assert type(tokenizer).__name__ == "SiglipTokenizer"

    tokens = encoder._tokens(TEXTS)
    assert list(tokens) == ["input_ids"]  # the tokens alone: no attention mask reaches the text tower
    ids = tokens["input_ids"].numpy()
    assert ids.shape == (3, 16)  # padded to max_length, the model's 16 positions, whatever the text's length
    for row, text in zip(ids, TEXTS):
        pieces = tokenizer(text)["input_ids"]  # lower-cased, punctuation dropped, then </s>
        assert pieces[-1] == tokenizer.eos_token_id and len(pieces) < 16
        assert row[:len(pieces)].tolist() == pieces
        assert (row[len(pieces):] == tokenizer.pad_token_id).all()  # padded on the right with </s>, SigLIP's pad

    reference = _documented(folder, TEXTS)
    assert np.abs(encoder.encode_texts(TEXTS) - reference).max() < 1e-5
    # the choice matters: with a mask over the padding, every embedding would be another one
    masked = _documented(folder, TEXTS, return_attention_mask=True)
    assert ((masked * reference).sum(1) < 0.999).all()

    long = "a " + " ".join(["waterproof"] * 20) + " boot"  # more pieces than positions: cut to the 16
    assert encoder._tokens([long])["input_ids"].shape == (1, 16) and encoder.encode_texts([long]).shape == (1, 32)


def test_a_siglip_tokenizer_that_returns_a_mask_is_still_run_without_it(tiny_model_folders):
    """The word-level tokenizer of the other tiny SigLIP returns an attention mask; SigLIP's text tower never
    gets one, so a folder's tokenizer settings cannot change its embeddings."""
    encoder = encoders.load(encoders.resolve(f"hf:{tiny_model_folders['siglip']}"), "cpu")
    assert "attention_mask" in encoder.tokenizer(["red shoe"])
    tokens = encoder._tokens(["red shoe", "a photo of a blue bag"])
    assert list(tokens) == ["input_ids"] and tuple(tokens["input_ids"].shape) == (2, 16)


@pytest.mark.parametrize("package, module", [("sentencepiece", "sentencepiece"), ("protobuf", "google.protobuf")])
def test_a_siglip_tokenizer_without_its_package_is_one_line_naming_the_fix(tiny_siglip_sentencepiece_folder,
                                                                          monkeypatch, package, module):
    spec = encoders.resolve(f"hf:{tiny_siglip_sentencepiece_folder}")
    monkeypatch.setitem(sys.modules, module, None)  # as if the package were not installed here
    monkeypatch.setattr(encoders, "_loaded", {})  # a process that has not loaded the model yet
    with pytest.raises(EncoderError) as refused:
        encoders.load(spec, "cpu")
    assert str(refused.value) == (f"{spec.name}: its tokenizer needs the {package} package, which is not installed "
                                  "here: pip install 'imgest[hf]'")


def test_an_ingest_of_a_siglip_without_sentencepiece_is_refused_in_one_line_before_any_work(
        tmp_path, tiny_siglip_sentencepiece, monkeypatch):
    from typer.testing import CliRunner

    from imgest.cli import app
    from tests.helpers import small_catalogue, write_files

    write_files(str(tmp_path / "catalogue"), small_catalogue(3))
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    result = CliRunner().invoke(app, ["ingest", "--catalogue", str(tmp_path / "catalogue"), "--store",
                                      str(tmp_path / "store"), "--model", f"hf:{tiny_siglip_sentencepiece}"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [f"imgest: error: hf:{tiny_siglip_sentencepiece}: its tokenizer needs the sentencepiece package, "
                     "which is not installed here: pip install 'imgest[hf]'"]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing listed or written


@pytest.mark.usefixtures("prefect_harness")
def test_search_by_text_answers_on_a_store_of_a_sentencepiece_siglip(tmp_path, tiny_siglip_sentencepiece,
                                                                     monkeypatch):
    """Ingested and indexed through the flows, searched by text through the CLI: the hits are the images nearest
    to transformers' own embedding of the text, by the scores it gives them; without sentencepiece the same search
    is one line naming the fix."""
    from typer.testing import CliRunner

    from imgest.cli import app
    from imgest.config import IndexConfig
    from imgest.flows.build_index import build_index
    from tests.helpers import small_catalogue, write_files

    model = f"hf:{tiny_siglip_sentencepiece}"
    cat, store = tmp_path / "catalogue", tmp_path / "store"
    files = small_catalogue(12)
    write_files(str(cat), files)
    summary = ingest_into(cat, store, model=model, runtime="torch", precision="fp32", batch_size="8", decoder="pillow")
    assert summary["encoded"] == 12
    build_index(IndexConfig(store=str(store), model=model, alias="serving"))

    runner = CliRunner()
    result = runner.invoke(app, ["search", "--store", str(store), "--text", "red shoe", "--k", "3", "--json"])
    assert result.exit_code == 0, result.output
    hits = json.loads(result.output)["results"][0]["hits"]
    assert len(hits) == 3

    from imgest.images.decode import decode_image

    encoder = encoders.load(encoders.resolve(model), "cpu")
    images = encoder.encode_images(np.stack([encoder.preprocess(decode_image(data)) for data in files.values()]))
    scores = images @ _documented(tiny_siglip_sentencepiece, ["red shoe"])[0]
    by_item = dict(zip(files, scores))
    assert [h["score"] for h in hits] == pytest.approx(sorted(scores, reverse=True)[:3], abs=1e-4)
    assert all(by_item[h["item_id"]] == pytest.approx(h["score"], abs=1e-4) for h in hits)  # ties may swap

    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    monkeypatch.setattr(encoders, "_loaded", {})
    refused = runner.invoke(app, ["search", "--store", str(store), "--text", "red shoe"])
    assert refused.exit_code == 2, refused.output
    lines = [line for line in refused.output.splitlines() if line.strip()]
    assert lines == [f"imgest: error: {model}: its tokenizer needs the sentencepiece package, which is not installed "
                     "here: pip install 'imgest[hf]'"]  # no fallback's warning, no weights loaded first
