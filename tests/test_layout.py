"""The layout a newcomer relies on: flows only wire, modules stay small, the architecture page's map is true, and
the flows, the configurations and the command line share one set of defaults."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("imgest", "flows", "tasks")


def _modules() -> list[pathlib.Path]:
    return sorted(p for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)


def _is_flow_decorator(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    return isinstance(target, ast.Name) and target.id == "flow"


@pytest.mark.parametrize("path", sorted((ROOT / "flows").glob("*.py")), ids=lambda p: p.name)
def test_flow_modules_define_flows_and_nothing_else(path):
    """Top level of a flows/ module: a docstring, imports, and functions decorated with @flow."""
    tree = ast.parse(path.read_text())
    for n, node in enumerate(tree.body):
        if n == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the module docstring
        if isinstance(node, ast.Import | ast.ImportFrom):
            continue
        if isinstance(node, ast.FunctionDef) and any(_is_flow_decorator(d) for d in node.decorator_list):
            continue
        what = getattr(node, "name", type(node).__name__)
        pytest.fail(f"{path.relative_to(ROOT)}:{node.lineno} defines {what!r}, which is not a flow: "
                    "stage logic belongs in tasks/")


def test_every_flow_module_defines_a_flow():
    for path in sorted((ROOT / "flows").glob("*.py")):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        assert any(isinstance(n, ast.FunctionDef) and any(_is_flow_decorator(d) for d in n.decorator_list)
                   for n in tree.body), f"{path.name} defines no flow"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_over_400_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= 400, f"{path.relative_to(ROOT)} has {lines} lines: split it by concept"


def test_layers_import_downwards_only():
    """tasks/ never imports flows/ or the command line; flows/ never imports the command line."""
    for directory, forbidden in (("tasks", ("imgest.flows", "imgest.cli")), ("flows", ("imgest.cli",)),
                                 ("imgest/encoders", ("imgest.flows", "imgest.tasks", "imgest.cli"))):
        for path in sorted((ROOT / directory).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                    [a.name for a in node.names] if isinstance(node, ast.Import) else []
                for name in names:
                    assert not name.startswith(forbidden), f"{path.relative_to(ROOT)} imports {name}"


def _architecture_table_paths() -> set[str]:
    section = (ROOT / "docs" / "architecture.md").read_text()
    paths = set()
    for row in section.splitlines():
        if row.startswith("| `"):
            paths.update(re.findall(r"`([a-z_/]+(?:\.py)?/?)`", row.split("|")[1]))
    return paths


def test_architecture_table_lists_every_module_and_only_real_ones():
    listed = _architecture_table_paths()
    assert listed, "docs/architecture.md has no architecture table"
    for path in listed:
        assert (ROOT / path).exists(), f"the architecture table names {path}, which does not exist"
    covered = {p for p in listed if p.endswith(".py")}
    folders = {p.rstrip("/") for p in listed if p.endswith("/")}
    for path in _modules():
        rel = str(path.relative_to(ROOT))
        if path.name == "__init__.py" and rel.split("/")[0] in ("flows", "tasks"):
            continue
        assert rel in covered or str(path.parent.relative_to(ROOT)) in folders, \
            f"{rel} is missing from the architecture table (docs/architecture.md)"


def _flow_defaults(fn) -> dict:
    return {name: p.default for name, p in inspect.signature(fn.fn).parameters.items()
            if p.default is not inspect.Parameter.empty}


def test_flows_configs_and_cli_share_their_defaults():
    """A deployment run and a CLI run with no options do the same thing."""
    import typer

    from imgest.cli import eval_cmds, index_cmds, ingest_cmds, migrate_cmds
    from imgest.config import IndexConfig, IngestConfig, MigrateConfig, NightlyConfig
    from imgest.flows.build_index import build_index
    from imgest.flows.ingest import ingest
    from imgest.flows.migrate import migrate
    from imgest.flows.nightly import nightly

    def config_defaults(cls) -> dict:
        return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}

    def cli_defaults(command) -> dict:
        out = {}
        for name, p in inspect.signature(command).parameters.items():
            if isinstance(p.default, typer.models.OptionInfo) and p.default.default is not ...:
                out[name] = p.default.default
        return out

    for flow_fn, cls, command in ((ingest, IngestConfig, ingest_cmds.ingest),
                                  (build_index, IndexConfig, index_cmds.build_index_cmd),
                                  (nightly, NightlyConfig, ingest_cmds.nightly),
                                  (migrate, MigrateConfig, migrate_cmds.migrate_start)):
        flow_d, cfg_d, cli_d = _flow_defaults(flow_fn), config_defaults(cls), cli_defaults(command)
        assert flow_d == {k: v for k, v in cfg_d.items() if k in flow_d}, flow_fn.name
        assert set(flow_d) == set(cfg_d), flow_fn.name
        shared = set(cli_d) & set(flow_d)
        assert shared, command.__name__
        assert {k: cli_d[k] for k in shared} == {k: flow_d[k] for k in shared}, command.__name__
    from imgest.defaults import DEFAULT_KS, DEFAULT_RESAMPLES

    eval_cli = cli_defaults(eval_cmds.eval_cmd)
    assert eval_cli["k"] == ",".join(map(str, DEFAULT_KS)) and eval_cli["resamples"] == DEFAULT_RESAMPLES


def test_the_encode_path_imports_without_prefect_or_faiss():
    """What bench/gpu_check.py relies on: a GPU machine can run decode, tuning and encode_shard with only
    torch, Pillow, pyarrow, fsspec and the model's own wheels."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['prefect'] = None; sys.modules['faiss'] = None; "
            "import imgest.encoders, imgest.tasks.encode, imgest.tasks.batch_size, imgest.tasks.decode")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
