"""A --metadata file is untrusted: its columns, a block's decoded size, a cell's and a line's length and JSONL
nesting are limited, each refusal one MetadataError naming the limit, found before the rows cost memory. The
row count is not limited: rows stream through in blocks (tests/test_metadata_scale.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from imgest.state import metadata_file
from imgest.state.metadata import (
    MAX_BLOCK_BYTES,
    MAX_CELL_CHARS,
    MAX_JSON_DEPTH,
    MAX_LINE_CHARS,
    MAX_METADATA_COLUMNS,
    MetadataError,
    read_metadata,
)

# In a subprocess that imports only imgest.state.metadata: the refusal and the peak RSS it added.
PROBE = """
import json, resource, sys
from imgest.state.metadata import MetadataError, read_metadata
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    read_metadata(sys.argv[1])
    said = None
except MetadataError as exc:
    said = str(exc)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"error": said, "added_mb": (after - before) / 1024}))
"""


def _refused_in_subprocess(path) -> dict:
    # the probe runs as a user's process does, without the suite's per-worker thread budget (tests/conftest.py)
    budget = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in budget}
    env["OPENBLAS_CORETYPE"] = os.environ.get("OPENBLAS_CORETYPE", "Haswell")
    done = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.slow("a subprocess")
def test_a_100000_column_csv_is_refused_from_its_header(tmp_path):
    """Accepted before at a 1.1 GB peak; now refused after the header line, adding under 30 MB of RSS (the
    file itself, 1.3 MB, is read and decoded once)."""
    columns = [f"c{n}" for n in range(100_000)]
    path = tmp_path / "wide.csv"
    path.write_text(",".join(["item_id", *columns]) + "\n"
                    + "".join(",".join([f"p/{r}.jpg"] + ["1"] * len(columns)) + "\n" for r in range(3)))
    result = _refused_in_subprocess(path)
    assert result["error"] == (f"{path} line 1: the header has 100001 columns; the limit is {MAX_METADATA_COLUMNS} "
                               "(MAX_METADATA_COLUMNS)")
    assert result["added_mb"] < 30, result


def test_jsonl_columns_count_across_lines(tmp_path):
    half = MAX_METADATA_COLUMNS // 2 + 100
    lines = [{"item_id": "a", **{f"x{n}": 1 for n in range(half)}},
             {"item_id": "b", **{f"y{n}": 1 for n in range(half)}}]
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    with pytest.raises(MetadataError, match=rf"m.jsonl line 2: the lines so far have {2 * half + 1} columns; the "
                                            rf"limit is {MAX_METADATA_COLUMNS}"):
        read_metadata(str(tmp_path / "m.jsonl"))


def test_a_parquet_file_with_too_many_columns_is_refused_from_its_footer(tmp_path):
    table = pa.table({"item_id": ["a"], **{f"c{n}": [n] for n in range(MAX_METADATA_COLUMNS)}})
    pq.write_table(table, tmp_path / "wide.parquet")
    with pytest.raises(MetadataError, match=rf"wide.parquet has {MAX_METADATA_COLUMNS + 1} columns; the limit is "
                                            rf"{MAX_METADATA_COLUMNS} \(MAX_METADATA_COLUMNS\)"):
        read_metadata(str(tmp_path / "wide.parquet"))


def test_a_csv_record_longer_than_a_block_is_refused_naming_its_line(tmp_path, monkeypatch):
    """A record must fit in one block (BLOCK_BYTES, 2 MiB); lowered here so the test writes kilobytes."""
    monkeypatch.setattr(metadata_file, "BLOCK_BYTES", 4_096)
    rows = "".join(f"p/{n}.jpg,title {n}\n" for n in range(500))
    (tmp_path / "m.csv").write_text("item_id,title\n" + rows + "p/x.jpg," + "y" * 20_000 + "\nq/1.jpg,t\n")
    with pytest.raises(MetadataError, match=r"m.csv line 502: a record longer than 4096 bytes \(BLOCK_BYTES\)"):
        read_metadata(str(tmp_path / "m.csv"))


def test_a_cell_longer_than_the_limit_is_refused(tmp_path):
    long = "x" * (MAX_CELL_CHARS + 1)
    (tmp_path / "m.csv").write_text(f"item_id,title\np/1.jpg,short\np/2.jpg,{long}\n")
    with pytest.raises(MetadataError, match=rf"m.csv line 3: .*{MAX_CELL_CHARS}"):  # the csv module's own field limit
        read_metadata(str(tmp_path / "m.csv"))
    pq.write_table(pa.table({"item_id": ["p/1.jpg", "p/2.jpg"], "title": ["short", long]}), tmp_path / "m.parquet")
    with pytest.raises(MetadataError, match=rf"column 'title' has a value of {MAX_CELL_CHARS + 1} bytes; the limit "
                                            rf"is {MAX_CELL_CHARS} \(MAX_CELL_CHARS\)"):
        read_metadata(str(tmp_path / "m.parquet"))


@pytest.mark.slow("a subprocess")
@pytest.mark.parametrize("arrow_schema", [True, False])  # without it, Parquet's own dictionary encoding
def test_a_parquet_dictionary_bomb_is_refused_before_it_is_expanded(tmp_path, arrow_schema):
    """One 100 KB title referenced by 20,000 rows: a 140 KB file that decodes to 2 GB of strings. Read as a
    dictionary, a block's decoded size is counted without expanding it: the first block of 8,192 rows (819 MB)
    is refused."""
    title = "t" * 100_000
    titles = pa.DictionaryArray.from_arrays(pa.array([0] * 20_000, pa.int32()), pa.array([title]))
    path = tmp_path / "bomb.parquet"
    pq.write_table(pa.table({"item_id": [f"p/{n}" for n in range(20_000)], "title": titles}), path,
                   store_schema=arrow_schema)
    assert path.stat().st_size < 1_000_000
    result = _refused_in_subprocess(path)
    # 8,192 x 100,000 bytes of titles, and the batch's own columns
    assert result["error"].startswith(f"{path}: rows 1-8192: 8196") and result["error"].endswith(
        f" bytes decoded; the limit is {MAX_BLOCK_BYTES} a block of rows (MAX_BLOCK_BYTES)"), result
    assert result["added_mb"] < 50, result


def test_a_jsonl_line_longer_than_the_limit_is_refused(tmp_path):
    line = json.dumps({"item_id": "a", "title": "x" * MAX_LINE_CHARS})
    (tmp_path / "m.jsonl").write_text('{"item_id": "b"}\n' + line + "\n")
    with pytest.raises(MetadataError, match=rf"m.jsonl line 2: {len(line)} characters; the limit is {MAX_LINE_CHARS} "
                                            r"\(MAX_LINE_CHARS\)"):
        read_metadata(str(tmp_path / "m.jsonl"))


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000])  # the second is past Python's own parser
def test_jsonl_nested_deeper_than_the_limit_is_refused(tmp_path, depth):
    (tmp_path / "m.jsonl").write_text('{"item_id": "a", "x": ' + "[" * depth + "]" * depth + "}\n")
    with pytest.raises(MetadataError, match=rf"m.jsonl line 1: nested deeper than {MAX_JSON_DEPTH} levels "
                                            r"\(MAX_JSON_DEPTH\)"):
        read_metadata(str(tmp_path / "m.jsonl"))


def test_a_jsonl_line_at_the_depth_limit_is_read(tmp_path):
    nested = "[" * (MAX_JSON_DEPTH - 1) + "1" + "]" * (MAX_JSON_DEPTH - 1)  # the row object is one level
    (tmp_path / "m.jsonl").write_text('{"item_id": "a", "x": ' + nested + "}\n")
    assert read_metadata(str(tmp_path / "m.jsonl")).num_rows == 1


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(MetadataError, match=r"nope.csv does not exist"):
        read_metadata(str(tmp_path / "nope.csv"))
