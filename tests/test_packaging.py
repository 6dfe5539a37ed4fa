"""One installed namespace: the wheel holds `imgest` only, and an install outside the checkout works without it."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _source_modules() -> set[str]:
    """Installed module paths the checkout should produce: imgest/ as is, flows/ and tasks/ under imgest/."""
    out = set()
    for folder, target in (("imgest", "imgest"), ("flows", "imgest/flows"), ("tasks", "imgest/tasks")):
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" not in path.parts:
                out.add(f"{target}/{path.relative_to(ROOT / folder)}")
    return out


def test_wheel_installs_imgest_only_with_every_module_and_the_deployments(installed_imgest):
    names = zipfile.ZipFile(installed_imgest["wheel"]).namelist()
    top = {n.split("/", 1)[0] for n in names}
    assert top == {"imgest", "imgest-0.1.0.dist-info"}, top
    assert {n for n in names if n.endswith(".py")} == _source_modules()
    assert "imgest/flows/prefect.yaml" in names


def _run(python: str, code: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([python, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_installed_outside_the_checkout_has_no_top_level_flows_or_tasks(installed_imgest, tmp_path):
    python = installed_imgest["python"]
    for name in ("flows", "tasks"):
        result = _run(python, f"import {name}", tmp_path)
        assert result.returncode != 0 and f"No module named '{name}'" in result.stderr, result.stderr
    result = _run(python, "import imgest, imgest.flows.nightly as n; from imgest import Searcher, search; "
                          "print(imgest.__file__); print(n.__file__); print(search.__module__)", tmp_path)
    assert result.returncode == 0, result.stderr
    where, nightly_file, api = result.stdout.split()
    site = installed_imgest["site"]
    assert where.startswith(site) and nightly_file.startswith(site), (where, nightly_file)
    assert api == "imgest.retrieval.query"


def test_installed_package_loads_every_deployment_entrypoint(installed_imgest, tmp_path):
    """What a worker does with prefect.yaml: each module-path entrypoint loads from the installed package."""
    code = ("import yaml, imgest.cli.prefect_stack as s; from prefect.flows import load_flow_from_entrypoint as load; "
            "spec = yaml.safe_load(open(s.deployments_file())); "
            "print(' '.join(load(d['entrypoint']).name for d in spec['deployments']))")
    result = _run(installed_imgest["python"], code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["nightly", "reencode", "migrate", "eval", "train-head"]


def test_the_checkout_is_not_what_the_installed_package_runs(installed_imgest, tmp_path):
    """Guard for the tests above: the fresh environment is not the development one, and does not see the
    checkout's sources (only the test environment's third-party packages)."""
    result = _run(installed_imgest["python"], "import sys; print(sys.prefix)", tmp_path)
    assert result.stdout.strip() != sys.prefix
    assert not installed_imgest["site"].startswith(str(ROOT))
    result = _run(installed_imgest["python"], "import imgest.flows, sys; print(imgest.flows.__path__[0])", tmp_path)
    assert result.stdout.strip().startswith(installed_imgest["site"]), result.stdout
