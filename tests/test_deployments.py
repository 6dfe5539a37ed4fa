"""prefect.yaml deploys against a real Prefect server: the nightly schedule and the manual flows."""

import os
import subprocess
import sys
from datetime import UTC

import pytest
import yaml

from imgest.config import CONFIGS, NightlyConfig

pytestmark = pytest.mark.usefixtures("prefect_harness")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def prefect_cli(*args, env):
    prefect = os.path.join(os.path.dirname(sys.executable), "prefect")
    out = subprocess.run([prefect, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


def test_every_entrypoint_is_a_flow_taking_its_config_and_the_deployments_set_only_non_defaults():
    from prefect.flows import load_flow_from_entrypoint

    spec = yaml.safe_load(open(os.path.join(ROOT, "prefect.yaml")))
    names = {d["name"] for d in spec["deployments"]}
    assert names == {"nightly", "reencode", "migrate", "eval", "train-head"}
    for deployment in spec["deployments"]:
        flow = load_flow_from_entrypoint(deployment["entrypoint"])  # a module path: the installed package
        model = CONFIGS[flow.name]
        assert list(flow.parameters.properties) == ["config"], flow.name
        given = deployment.get("parameters", {}).get("config", {})
        for name, value in given.items():  # a default written here would go stale when the model's changes
            assert model.model_fields[name].is_required() or model.model_fields[name].default != value, \
                f"deployment {deployment['name']} sets {name} to its default"
        required = {n: "x" for n, f in model.model_fields.items() if f.is_required()}
        validated = flow.validate_parameters({"config": {**required, **given}})
        assert isinstance(validated["config"], model)


def test_prefect_deploy_all_creates_the_deployments():
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PWD": ROOT}
    prefect_cli("work-pool", "create", "imgest-process", "--type", "process", "--overwrite", env=env)
    prefect_cli("--no-prompt", "deploy", "--all", env=env)
    with get_client(sync_client=True) as client:
        deployments = {d.name: d for d in client.read_deployments()}
    assert {"nightly", "reencode", "migrate", "eval"} <= set(deployments)
    nightly = deployments["nightly"]
    schedule = nightly.schedules[0].schedule
    assert schedule.cron == "0 2 * * *" and schedule.timezone == "Europe/London"
    # no model parameter: the nightly follows the models the aliases point at (a finished migration needs no edit)
    assert "model" not in nightly.parameters["config"] and nightly.work_pool_name == "imgest-process"
    assert not deployments["reencode"].schedules and not deployments["migrate"].schedules


def test_runs_are_named_for_people_and_tagged_by_model(tmp_path):
    from datetime import datetime

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    from imgest.flows.nightly import nightly
    from tests.helpers import gradient, png_bytes, task_runs_named, write_files

    write_files(str(tmp_path / "cat"), {f"{i}.png": png_bytes(gradient(i)) for i in range(3)})
    result = nightly(NightlyConfig(catalogue=str(tmp_path / "cat"), store=str(tmp_path / "store"), model="raw-pixels",
                                   batch_size="4"))
    today = datetime.now(UTC).strftime("%Y-%m-%d")
    expected = [f"nightly-{today}", f"ingest-{today}-raw-pixels", f"build-index-{today}-{result['ingest']['slug']}"]
    with get_client(sync_client=True) as client:  # filtered by name: the session's server holds many runs
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=expected)),
                                     sort=FlowRunSort.START_TIME_DESC)
    assert {r.name for r in runs} == set(expected)
    ingest_run = next(r for r in runs if r.name == expected[1])  # this test's: the latest of that name
    task_runs = task_runs_named("encode-", 1, flow_run_id=ingest_run.id)
    encode_tags = {t for tr in task_runs for t in tr.tags}
    assert f"model:{result['ingest']['slug']}" in encode_tags
