"""`gymflow kube`: the manifests a team applies to run a preset on Kubernetes, checked offline
against the Kubernetes API's schemas (kubernetes-validate, tasks/cluster/kube.py's
KUBERNETES_VERSION) and the dask-kubernetes operator's own DaskCluster CRD. What cannot run
here (an API server, the operator) is said in docs/cluster.md."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gymflow.errors import InvalidPreset
from gymflow.flows.cli import main
from gymflow.tasks.cluster.kube import (
    GPU,
    STORAGE_SECRET,
    TLS_MOUNT,
    TLS_SECRET,
    TLS_SECRET_FILE,
    TRACKING_SECRET,
    KubeTarget,
    check,
    job_as_the_worker_makes_it,
    manifests,
)
from tests.conftest import intruders_let_in

REPO = Path(__file__).resolve().parents[1]
IMAGE = "registry.example.com/team/gymflow:1.0"
PASSWORD = "alice-s-password"  # in the tracking URI given: never in what is written


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict:
    """What `gymflow kube` wrote, read back: the module's tests share it (each check reads its ~20
    schemas from disk: ~3 s), and spoil copies of it."""
    tmp_path = tmp_path_factory.mktemp("kube")
    assert main(["kube", "cartpole-ppo", "--image", IMAGE, "--set", "storage.root=s3://team-bucket/gymflow",
                 "--set", f"tracking.tracking_uri=https://alice:{PASSWORD}@mlflow.example.com",
                 "--set", "distribution.rollout_workers=6", "--set", "distribution.rollout_resources={ROLLOUT: 1}",
                 "--worker-cpu", "2", "--worker-memory", "3Gi", "--learner-gpus", "1", "--namespace", "rl",
                 "--out", str(tmp_path / "kube")]) == 0
    folder = tmp_path / "kube"
    assert not [path.name for path in folder.iterdir() if PASSWORD in path.read_text()]  # its pod reads the Secret
    assert (folder / TLS_SECRET_FILE).stat().st_mode & 0o777 == 0o600  # it holds the cluster's private key
    assert (folder / "secrets.yaml").stat().st_mode & 0o777 == 0o600  # users fill it with real keys in place
    return {"daskcluster.yaml": yaml.safe_load((folder / "daskcluster.yaml").read_text()),
            "secrets.yaml": list(yaml.safe_load_all((folder / "secrets.yaml").read_text())),
            TLS_SECRET_FILE: yaml.safe_load((folder / TLS_SECRET_FILE).read_text()),
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
    address = "tls://gymflow-scheduler.rl.svc.cluster.local:8786"  # the scheduler's Service, mutual TLS
    tls_options = ["--tls-ca-file", f"{TLS_MOUNT}/ca.pem", "--tls-cert", f"{TLS_MOUNT}/cert.pem",
                   "--tls-key", f"{TLS_MOUNT}/key.pem"]
    assert container["args"][:9] == ["dask", "worker", address, *tls_options]
    assert container["args"][-2:] == ["--resources", "ROLLOUT=1"]
    assert container["resources"]["requests"] == {"cpu": "2", "memory": "3Gi"}
    assert _secret_refs(container) == {STORAGE_SECRET}  # the workers write shards, never to MLflow
    (scheduler,) = cluster["spec"]["scheduler"]["spec"]["containers"]
    assert scheduler["args"] == ["dask", "scheduler", "--protocol", "tls", *tls_options] and scheduler["image"] == IMAGE
    assert "envFrom" not in scheduler  # no credential reaches the scheduler, which runs any client's code

    job = job_as_the_worker_makes_it(written["work-pool-template.json"])
    (learner,) = job["spec"]["template"]["spec"]["containers"]
    assert learner["image"] == IMAGE and learner["args"] == ["prefect", "flow-run", "execute"]
    assert learner["resources"]["limits"][GPU] == 1 and job["metadata"]["namespace"] == "rl"
    assert _secret_refs(learner) == {STORAGE_SECRET, TRACKING_SECRET}
    assert written["overrides.yaml"] == {"distribution.scheduler_address": address,
                                         "storage.root": "s3://team-bucket/gymflow",
                                         "tracking.tracking_uri": "https://alice@mlflow.example.com",
                                         "distribution.tls": {"ca_file": f"{TLS_MOUNT}/ca.pem",
                                                              "cert_file": f"{TLS_MOUNT}/cert.pem",
                                                              "key_file": f"{TLS_MOUNT}/key.pem"}}
    # the certificate mounted read-only where a pod speaks to the scheduler, and nowhere else
    for pod in (worker["spec"], cluster["spec"]["scheduler"]["spec"], job["spec"]["template"]["spec"]):
        assert pod["volumes"] == [{"name": "dask-tls", "secret": {"secretName": TLS_SECRET, "defaultMode": 0o400}}]
        (mounted,) = pod["containers"]
        assert mounted["volumeMounts"] == [{"name": "dask-tls", "mountPath": TLS_MOUNT, "readOnly": True}]
    assert written[TLS_SECRET_FILE]["metadata"] == {"name": TLS_SECRET, "namespace": "rl"}
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


def test_the_written_certificate_lets_in_the_cluster_s_own_clients_and_no_one_else(written, tmp_path):
    """A scheduler started as the manifests start it (`dask scheduler --protocol tls` and the Secret's
    files): a client presenting the Secret's certificate is let in; one without a certificate and one
    with a self-signed certificate of its own are refused."""
    from distributed import Client
    from distributed.security import Security

    from gymflow.testing.s3 import free_port

    folder = tmp_path / "dask-tls"
    folder.mkdir(mode=0o700)
    for name, pem in written[TLS_SECRET_FILE]["stringData"].items():
        (folder / name).write_text(pem)
    scheduler = written["daskcluster.yaml"]["spec"]["scheduler"]["spec"]["containers"][0]["args"]
    args = [str(folder / Path(arg).name) if arg.startswith(TLS_MOUNT) else arg for arg in scheduler[1:]]
    port = free_port()
    process = subprocess.Popen([str(Path(sys.executable).with_name("dask")), *args, "--host", "127.0.0.1",
                                "--port", str(port), "--dashboard-address", "127.0.0.1:0"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        address = f"tls://127.0.0.1:{port}"
        own = Security(tls_ca_file=str(folder / "ca.pem"), tls_client_cert=str(folder / "cert.pem"),
                       tls_client_key=str(folder / "key.pem"), require_encryption=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                with Client(address, security=own, timeout=5) as client:
                    assert client.scheduler_info()["address"] == address
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, "the scheduler did not start"
                time.sleep(0.5)
        assert intruders_let_in(address) == []
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_preset_that_asks_for_plain_tcp_gets_no_certificate(tmp_path):
    from gymflow.presets.validate import resolve_experiment

    preset = resolve_experiment("cartpole-ppo", {"storage.root": "s3://b/g", "tracking.tracking_uri": "https://m",
                                                 "distribution.cluster_tls": False}).preset
    files = manifests(preset, KubeTarget(IMAGE))
    assert TLS_SECRET_FILE not in files and "distribution.tls" not in files["overrides.yaml"]
    assert files["overrides.yaml"]["distribution.scheduler_address"].startswith("tcp://")
    assert files["daskcluster.yaml"]["spec"]["scheduler"]["spec"]["containers"][0]["args"] == ["dask", "scheduler"]


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
    assert "RUN make setup EXTRAS=all" in dockerfile and "ENV PATH=/opt/gymflow/.venv/bin:$PATH" in dockerfile
    assert "make train" in (REPO / "README.md").read_text()  # the README's commands set up through make setup
    assert "train: setup" in (REPO / "Makefile").read_text()
