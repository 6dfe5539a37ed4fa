"""The layout a newcomer relies on: flows only wire, stages stand side by side on the floors below them, imports
run one way without cycles and resolve as files, and the architecture page's map is true."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("imgest", "flows", "tasks")


def _modules() -> list[pathlib.Path]:
    """Every module once: imgest/tasks and imgest/flows are links to tasks/ and flows/, walked there."""
    return sorted(p for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py")
                  if "__pycache__" not in p.parts and p.relative_to(ROOT).parts[:2] not in
                  (("imgest", "tasks"), ("imgest", "flows")))


def _is_flow_decorator(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    return isinstance(target, ast.Name) and target.id in ("flow", "configured_flow")


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


# Layers, lowest first: a module imports only its own layer and those below; nothing imports the command line.
# `tasks` holds the stages, side by side: a stage imports the floors below it (core), never another stage.
LAYERS = ("errors", "names", "core", "tasks", "reports", "flows", "cli")


def _layer(module: str) -> str:
    parts = module.split(".")
    if module == "imgest.errors":
        return "errors"
    if module == "imgest.names":
        return "names"
    if len(parts) > 1 and parts[1] in ("tasks", "reports", "flows", "cli"):
        return parts[1]
    if module == "imgest":
        return "cli"  # the package's API facade (imports lazily)
    return "core"  # the floors: state, images, retrieval, storage, lock, config, records, encoders, ...


def _stage(module: str) -> str | None:
    """The stage a module belongs to (`imgest.tasks.index.build` -> "index"), None outside tasks/."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "tasks" else None


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts) if rel.parts[0] == "imgest" else ["imgest", *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """Every `imgest.*` module a file imports, at any depth (lazy imports inside functions included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:  # `from imgest import encoders` imports the module imgest.encoders
                sub = f"{node.module}.{alias.name}"
                found.append((node.lineno, sub if _resolves(sub) else node.module))
    return [(n, m) for n, m in found if m == "imgest" or m.startswith(("imgest.", "tasks", "flows"))]


def _resolves(module: str) -> pathlib.Path | None:
    """Where an editor finds a module in the checkout: a file or package under imgest/ (flows/, tasks/ linked)."""
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def test_every_module_imports_downwards_only():
    """errors <- names <- core (state, images, retrieval, storage, lock, config, encoders) <- tasks <- reports <-
    flows <- cli; checked on every module."""
    modules = _modules()
    assert len(modules) > 80 and any(p.parts[-3:-1] == ("tasks", "index") for p in modules)
    for path in modules:
        own = _module_name(path)
        for line, imported in _imports(path):
            where = f"{path.relative_to(ROOT)}:{line} imports {imported}"
            assert not imported.startswith(("tasks", "flows")), f"{where}: use imgest.{imported}"
            if own == "imgest":
                continue  # the facade: `from imgest import search` loads tasks lazily, on first use
            assert imported != "imgest", f"{where}: the package root; import the module that holds the name"
            assert LAYERS.index(_layer(imported)) <= LAYERS.index(_layer(own)), f"{where}, a layer above it"
            if _layer(imported) == "cli":
                assert _layer(own) == "cli", f"{where}: nothing imports the command line"
            if own == "imgest.errors":
                pytest.fail(f"{where}: imgest.errors is the leaf, it imports nothing of imgest")


def _graph() -> dict[str, set[str]]:
    """Module -> the imgest modules it imports, lazy (function-level) imports included."""
    return {_module_name(path): {imported for _, imported in _imports(path)} for path in _modules()}


_GRAPH: dict[str, set[str]] = {}


def _cycle_through(module: str, graph: dict[str, set[str]]) -> list[str] | None:
    """The shortest import chain from `module` back to itself, or None (breadth first, so the report is short)."""
    paths = {module: [module]}
    frontier = [module]
    while frontier:
        following = []
        for current in frontier:
            for imported in sorted(graph.get(current, ())):
                if imported == module:
                    return [*paths[current], module]
                if imported not in paths:
                    paths[imported] = [*paths[current], imported]
                    following.append(imported)
        frontier = following
    return None


def test_the_cycle_check_finds_a_lazy_cycle_and_passes_a_chain():
    chain = {"a": {"b"}, "b": {"c"}, "c": set()}
    assert all(_cycle_through(m, chain) is None for m in chain)
    assert _cycle_through("a", {**chain, "c": {"a"}}) == ["a", "b", "c", "a"]


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_leans_only_on_floors_below_and_on_no_cycle(path):
    """Stages stand side by side: a module of one stage imports its own stage and the floors below, never another
    stage (flows wire stages; what two stages both need is a concept of a floor). And no module is on an import
    cycle, lazy imports included. One concept per module; its size follows (a long module is advice to read it
    again, not a failure)."""
    own = _module_name(path)
    for line, imported in _imports(path):
        if _stage(own) and _stage(imported) and _stage(imported) != _stage(own):
            pytest.fail(f"{path.relative_to(ROOT)}:{line} imports {imported}: the {_stage(own)} stage imports the "
                        f"{_stage(imported)} stage; move what both need to a floor below (imgest/) or wire them in "
                        "a flow")
    if not _GRAPH:
        _GRAPH.update(_graph())
    cycle = _cycle_through(own, _GRAPH)
    assert cycle is None, f"{path.relative_to(ROOT)} is on an import cycle: {' -> '.join(cycle)}"


def test_every_imgest_import_resolves_to_a_file_an_editor_can_open():
    """Editors and type checkers resolve `imgest.tasks.index.build` as a path under the checkout: imgest/tasks
    and imgest/flows are links to the top-level folders, so no import goes through an import hook."""
    for name in ("tasks", "flows"):
        link = ROOT / "imgest" / name
        assert link.is_symlink() and link.resolve() == ROOT / name, f"imgest/{name} must link to {name}/"
    for path in _modules() + sorted((ROOT / "tests").glob("*.py")):
        for line, imported in _imports(path):
            assert _resolves(imported), f"{path.relative_to(ROOT)}:{line}: {imported} is not a file under imgest/"


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


@pytest.mark.slow("a subprocess")
def test_the_encode_path_imports_without_prefect_or_faiss():
    """What bench/gpu_check.py relies on: a GPU machine can run decode, tuning and encode_shard with only
    torch, Pillow, pyarrow, fsspec and the model's own wheels."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['prefect'] = None; sys.modules['faiss'] = None; "
            "import imgest.encoders, imgest.tasks.ingest.encode, imgest.tasks.ingest.batch_size, "
            "imgest.images.decode")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


# -- the store's layout: spelled in imgest/state/layout.py alone -------------------------------------------
def _store_folders() -> tuple[str, ...]:
    from imgest.state import layout

    return tuple(value for name, value in vars(layout).items() if name.isupper() and isinstance(value, str)
                 and "/" not in value and value.isalpha())


def _spelled_keys(source: str) -> list[tuple[int, str]]:
    """String literals (f-strings by their leading text) that start with one of the store's folders and a slash,
    docstrings left out."""
    tree = ast.parse(source)
    starts = re.compile(rf"^({'|'.join(_store_folders())})/")
    skipped = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value,
                                                                                             ast.Constant):
            skipped.add(id(body[0].value))  # a docstring describes the layout; it does not build a key
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            skipped.update(id(v) for v in node.values)
            head = node.values[0] if node.values else None
            if isinstance(head, ast.Constant) and isinstance(head.value, str) and starts.match(head.value):
                found.append((node.lineno, head.value))
    found += [(node.lineno, node.value) for node in ast.walk(tree) if isinstance(node, ast.Constant)
              and isinstance(node.value, str) and id(node) not in skipped and starts.match(node.value)]
    return found


def test_the_key_finder_finds_a_spelled_key_and_passes_a_built_one():
    assert _spelled_keys('KEY = "migration/window.json"\nkey = f"runs/{run}.json"\n') == [
        (2, "runs/"), (1, "migration/window.json")]
    assert _spelled_keys('"""Writes state/model=<slug>/x.json."""\nkey = layout.run_summary_key(run)\n'
                         'msg = f"model={slug} v{version}"\n') == []


def test_no_module_but_the_layout_spells_a_store_key():
    spelled = {str(path.relative_to(ROOT)): found for path in _modules() if path.name != "layout.py"
               if (found := _spelled_keys(path.read_text()))}
    assert not spelled, f"store keys built from strings (a key is built by imgest/state/layout.py): {spelled}"


def test_the_store_page_shows_the_layout_and_the_layout_sits_below_every_floor():
    from imgest.state import layout

    page = (ROOT / "docs" / "store.md").read_text()
    assert "```\n" + layout.tree_text() + "```\n" in page, "docs/store.md's tree is layout.tree_text()"
    assert {path.split("/")[0] for path, _ in layout.TREE} == set(_store_folders())
    imported = {m for _, m in _imports(ROOT / "imgest" / "state" / "layout.py")}
    assert imported <= {"imgest.storage.records"}, f"the layout leans on {imported}: images and encoders sit above it"


# The floors below the stages, lowest first: a module of one imports only its own floor and those below it.
FLOORS = ("storage", "layout", "images", "encoders", "state", "retrieval")


def _floor(module: str) -> str | None:
    if module == "imgest.state.layout":
        return "layout"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FLOORS else None


def test_the_floors_import_one_way():
    """storage < the store's layout < images < encoders < state (the writer lock among it) < retrieval: what reads
    index cards (status) sits on the retrieval floor, and the layout below everything that builds a key."""
    for path in _modules():
        own = _floor(_module_name(path))
        if own is None:
            continue
        for line, imported in _imports(path):
            floor = _floor(imported)
            assert floor is None or FLOORS.index(floor) <= FLOORS.index(own), \
                f"{path.relative_to(ROOT)}:{line} imports {imported}, a floor above {own}"


def _module_attributes(path: pathlib.Path) -> list[tuple[int, str, str]]:
    """(line, module, attribute) for each `alias.attribute` read where `alias` is an imgest module the file imports
    and no function there binds the name to something else (a parameter or an assignment)."""
    tree = ast.parse(path.read_text())
    modules = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("imgest"):
            for alias in node.names:
                if _resolves(f"{node.module}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            modules.update({a.asname: a.name for a in node.names if a.asname and a.name.startswith("imgest")})
    shadowed: set[int] = set()
    for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)):
        bound = {a.arg for a in function.args.args + function.args.kwonlyargs + function.args.posonlyargs}
        bound |= {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        shadowed |= {id(n) for n in ast.walk(function) if isinstance(n, ast.Attribute)
                     and isinstance(n.value, ast.Name) and n.value.id in bound}
    return [(n.lineno, modules[n.value.id], n.attr) for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and isinstance(n.value, ast.Name)
            and n.value.id in modules and id(n) not in shadowed]


def test_every_module_attribute_read_exists():
    """A name read from an imported imgest module (`watermark.SYNC_DIR`) exists there: a rename or a removed
    re-export fails here, not in the one flow that reads it."""
    import importlib

    missing = []
    for path in [*_modules(), *sorted((ROOT / "tests").glob("*.py"))]:
        for line, module, attribute in _module_attributes(path):
            if not hasattr(importlib.import_module(module), attribute):
                missing.append(f"{path.relative_to(ROOT)}:{line} {module}.{attribute}")
    assert not missing, missing
