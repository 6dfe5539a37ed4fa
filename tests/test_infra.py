"""infra/: the Kubernetes work-pool base job template is one Prefect accepts and renders with GPU requests."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.usefixtures("prefect_harness")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _template() -> dict:
    with open(os.path.join(ROOT, "infra", "k8s", "base-job-template.json")) as fh:
        return json.load(fh)


def test_kubernetes_pool_accepts_the_template_and_renders_gpu_requests():
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.utilities.templating import apply_values

    template = _template()
    with get_client(sync_client=True) as client:
        # The server checks that every placeholder of the job configuration is a declared variable.
        client.create_work_pool(WorkPoolCreate(name="imgest-k8s", type="kubernetes", base_job_template=template),
                                overwrite=True)
        pool = client.read_work_pool("imgest-k8s")
    assert pool.base_job_template == template

    variables = template["variables"]["properties"]
    defaults = {name: spec["default"] for name, spec in variables.items() if "default" in spec}
    values = {**defaults, "name": "nightly-2026-11-29", "command": "prefect flow-run execute", "gpus": 2,
              "image": "registry.example/imgest:cuda"}
    manifest = apply_values(template["job_configuration"]["job_manifest"], values)
    pod = manifest["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert container["image"] == "registry.example/imgest:cuda"
    assert container["envFrom"][0]["secretRef"]["name"] == "imgest-s3", "credentials from a Secret"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert "AWS_SECRET_ACCESS_KEY" not in json.dumps(defaults), "no credentials in the template"
    # a memory-backed /dev/shm for the decode processes' pixel slots (a container's default is 64 MB)
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_kubernetes_deployments_deploy_to_that_pool():
    import subprocess
    import sys

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL

    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name="imgest-k8s", type="kubernetes", base_job_template=_template()),
                                overwrite=True)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "IMGEST_IMAGE": "registry.example/imgest:cuda"}
    prefect = os.path.join(os.path.dirname(sys.executable), "prefect")
    out = subprocess.run([prefect, "--no-prompt", "deploy", "--all", "--prefect-file", "infra/k8s/prefect.yaml"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    with get_client(sync_client=True) as client:
        nightly = client.read_deployment_by_name("nightly/nightly-gpu")
    assert nightly.work_pool_name == "imgest-k8s"
    assert nightly.job_variables["gpus"] == 1 and nightly.job_variables["image"] == "registry.example/imgest:cuda"
    assert nightly.schedules[0].schedule.cron == "0 2 * * *"
