"""`gymflow kube`: the manifests a team applies to run a preset on Kubernetes, checked offline
against the Kubernetes API's schemas (kubernetes-validate, tasks/cluster/kube.py's
KUBERNETES_VERSION) and the dask-kubernetes operator's own DaskCluster CRD. What cannot run
here (an API server, the operator) is said in docs/cluster.md."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from gymflow.errors import InvalidPreset
from gymflow.flows.cli import main
from gymflow.tasks.cluster.kube import GPU, STORAGE_SECRET, TRACKING_SECRET, check, job_as_the_worker_makes_it

REPO = Path(__file__).resolve().parents[1]
IMAGE = "registry.example.com/team/gymflow:1.0"


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict:
    """What `gymflow kube` wrote, read back: the module's tests share it (each check reads its ~20
    schemas from disk: ~3 s), and spoil copies of it."""
    tmp_path = tmp_path_factory.mktemp("kube")
    assert main(["kube", "cartpole-ppo", "--image", IMAGE, "--set", "storage.root=s3://team-bucket/gymflow",
                 "--set", "tracking.tracking_uri=https://mlflow.example.com",
                 "--set", "distribution.rollout_workers=6", "--set", "distribution.rollout_resources={ROLLOUT: 1}",
                 "--worker-cpu", "2", "--worker-memory", "3Gi", "--learner-gpus", "1", "--namespace", "rl",
                 "--out", str(tmp_path / "kube")]) == 0
    folder = tmp_path / "kube"
    return {"daskcluster.yaml": yaml.safe_load((folder / "daskcluster.yaml").read_text()),
            "secrets.yaml": list(yaml.safe_load_all((folder / "secrets.yaml").read_text())),
            "work-pool-template.json": json.loads((folder / "work-pool-template.json").read_text()),
            "overrides.yaml": yaml.safe_load((folder / "overrides.yaml").read_text())}


def _secret_refs(container: dict) -> set[str]:
    return {source["secretRef"]["name"] for source in container["envFrom"]}


def test_the_manifests_validate_and_carry_what_the_preset_and_options_ask_for(written):
    check(written)  # as written to disk, again: the API's schemas and the operator's CRD
    cluster = written["daskcluster.yaml"]
    assert (cluster["apiVersion"], cluster["kind"], cluster["metadata"]["namespace"]) == (
        "kubernetes.dask.org/v1", "DaskCluster", "rl")
    worker = cluster["spec"]["worker"]
    (container,) = worker["spec"]["containers"]
    assert worker["replicas"] == 6 and container["image"] == IMAGE
    assert container["args"][:2] == ["dask", "worker"] and container["args"][-2:] == ["--resources", "ROLLOUT=1"]
    assert container["resources"]["requests"] == {"cpu": "2", "memory": "3Gi"}
    assert _secret_refs(container) == {STORAGE_SECRET}  # the workers write shards, never to MLflow
    (scheduler,) = cluster["spec"]["scheduler"]["spec"]["containers"]
    assert scheduler["args"] == ["dask", "scheduler"] and scheduler["image"] == IMAGE
    assert "envFrom" not in scheduler  # no credential reaches the scheduler, which runs any client's code

    job = job_as_the_worker_makes_it(written["work-pool-template.json"])
    (learner,) = job["spec"]["template"]["spec"]["containers"]
    assert learner["image"] == IMAGE and learner["args"] == ["prefect", "flow-run", "execute"]
    assert learner["resources"]["limits"][GPU] == 1 and job["metadata"]["namespace"] == "rl"
    assert _secret_refs(learner) == {STORAGE_SECRET, TRACKING_SECRET}
    address = "tcp://gymflow-scheduler.rl.svc.cluster.local:8786"  # the scheduler's Service
    assert written["overrides.yaml"] == {"distribution.scheduler_address": address,
                                         "storage.root": "s3://team-bucket/gymflow",
                                         "tracking.tracking_uri": "https://mlflow.example.com"}
    assert [secret["metadata"]["name"] for secret in written["secrets.yaml"]] == [STORAGE_SECRET, TRACKING_SECRET]


@pytest.mark.parametrize(("spoil", "says"), [
    (lambda files: files["daskcluster.yaml"]["spec"]["worker"].update(replicas="two"),
     r"^DaskCluster/gymflow: spec\.worker\.replicas: 'two' is not of type 'integer'"),
    (lambda files: files["daskcluster.yaml"]["spec"]["worker"]["spec"]["containers"][0].update(imagePull="Always"),
     r"^DaskCluster/gymflow: spec\.worker\.spec\.containers\.0: .*'imagePull' was unexpected"),
    (lambda files: files["work-pool-template.json"]["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
     .update(restartPolicy=7), r"^Job/gymflow-: spec\.template\.spec\.restartPolicy: 7 is not of type 'string'"),
])
def test_a_manifest_the_api_or_the_operator_would_refuse_is_refused_in_one_line(written, spoil, says):
    spoiled = copy.deepcopy(written)
    spoil(spoiled)
    with pytest.raises(InvalidPreset, match=says):
        check(spoiled)


@pytest.mark.parametrize(("changes", "says"), [
    ([], "storage.root: 'gymflow-data' is a folder of one machine"),
    (["--set", "storage.root=s3://b/g"], "tracking.tracking_uri: 'sqlite:///mlflow.db' is a store in the flow's pod"),
])
def test_stores_of_one_machine_are_refused_for_a_cluster_of_pods(tmp_path, capsys, changes, says):
    assert main(["kube", "cartpole-ppo", "--image", IMAGE, *changes, "--out", str(tmp_path / "kube")]) == 2
    assert capsys.readouterr().err.startswith(f"gymflow: error: {says}")
    assert not (tmp_path / "kube").exists()


def test_the_image_installs_gymflow_as_the_readme_does():
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "RUN make setup" in dockerfile and "ENV PATH=/opt/gymflow/.venv/bin:$PATH" in dockerfile
    assert "make test" in (REPO / "README.md").read_text()  # the README's commands set up through make setup
    assert "test: setup" in (REPO / "Makefile").read_text()
