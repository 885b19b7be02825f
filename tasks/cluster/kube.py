"""What a team applies to run gymflow on Kubernetes, made from a preset (`gymflow kube`):

- a `DaskCluster` for the dask-kubernetes operator: the scheduler behind its Service, and one
  worker pod per rollout worker, with the resources the preset's rollouts ask for;
- a Prefect Kubernetes work pool's base job template, whose Job runs the improve and retraining
  flows (the learner: its CPUs, memory and GPU);
- the Secrets both read their credentials from (S3 storage, the MLflow server), as templates;
- the Dask cluster's certificate as a Secret of its own (`distribution.cluster_tls`, on by
  default): a key and certificate made here, mounted read-only in the scheduler, the workers and
  the flow's Job, nowhere else, so the scheduler takes only their connections (mutual TLS);
- the preset overrides that point a run at that cluster.

Every object is checked against the Kubernetes API's schemas (kubernetes-validate, at
KUBERNETES_VERSION) and the DaskCluster against the operator's own CRD schema before it is
written (`check`). Nothing here talks to a cluster.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gymflow.errors import InvalidPreset
from gymflow.files import write_whole
from gymflow.presets.model import Preset
from gymflow.presets.redaction import redacted_uri, without_password
from gymflow.tasks.tracking.servers import is_tracking_server

KUBERNETES_VERSION = "1.33.0"  # the API the manifests are checked against
DASK_OPERATOR = "dask-kubernetes 2026.3.0"  # whose DaskCluster CRD they are checked against
STORAGE_SECRET, TRACKING_SECRET, TLS_SECRET = "gymflow-storage", "gymflow-tracking", "gymflow-dask-tls"
TLS_MOUNT = "/etc/gymflow/dask-tls"  # where the pods that speak to the scheduler read its certificate
TLS_FILES = {"ca_file": "ca.pem", "cert_file": "cert.pem", "key_file": "key.pem"}  # distribution.tls's fields
TLS_SECRET_FILE = "dask-tls-secret.yaml"  # holds a private key: written 0600
SCHEDULER_PORT, DASHBOARD_PORT = 8786, 8787
GPU = "nvidia.com/gpu"  # the device plugin's resource name


@dataclass(frozen=True)
class KubeTarget:
    """Where and with what the manifests run (gymflow kube's options)."""

    image: str  # built from the repository's Dockerfile
    name: str = "gymflow"
    namespace: str = "default"
    worker_cpu: str = "1"
    worker_memory: str = "2Gi"
    learner_cpu: str = "4"
    learner_memory: str = "8Gi"
    learner_gpus: int = 0

    def scheduler_address(self, tls: bool) -> str:
        return f"{'tls' if tls else 'tcp'}://{self.name}-scheduler.{self.namespace}.svc.cluster.local:{SCHEDULER_PORT}"


def manifests(preset: Preset, target: KubeTarget) -> dict[str, Any]:
    """file name -> content: each a dict (YAML or JSON) or a list of dicts (several YAML documents)."""
    tls = preset.distribution.cluster_tls
    return {
        "daskcluster.yaml": dask_cluster(preset, target),
        "secrets.yaml": secrets(target),
        **({TLS_SECRET_FILE: tls_secret(target)} if tls else {}),
        "work-pool-template.json": work_pool_template(target, tls),
        "overrides.yaml": overrides(preset, target),
    }


def tls_secret(target: KubeTarget) -> dict[str, Any]:
    """The cluster's key and self-signed certificate (Dask's `Security.temporary`: the CA its peers
    check each other against), made here for this cluster: who holds the key file gets in."""
    from distributed.security import Security

    made = Security.temporary()
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": TLS_SECRET, "namespace": target.namespace},
            "stringData": {TLS_FILES["ca_file"]: made.tls_ca_file, TLS_FILES["cert_file"]: made.tls_scheduler_cert,
                           TLS_FILES["key_file"]: made.tls_scheduler_key}}


def _tls_options() -> list[str]:
    """`dask scheduler|worker` options naming the mounted certificate files (paths, no secret)."""
    mounted = {field: f"{TLS_MOUNT}/{name}" for field, name in TLS_FILES.items()}
    return ["--tls-ca-file", mounted["ca_file"], "--tls-cert", mounted["cert_file"], "--tls-key", mounted["key_file"]]


def _with_certificate(pod: dict[str, Any]) -> dict[str, Any]:
    """`pod`'s spec with the certificate Secret mounted read-only in its one container."""
    (container,) = pod["containers"]
    container["volumeMounts"] = [{"name": "dask-tls", "mountPath": TLS_MOUNT, "readOnly": True}]
    pod["volumes"] = [{"name": "dask-tls", "secret": {"secretName": TLS_SECRET, "defaultMode": 0o400}}]
    return pod


def _secret_env(names: tuple[str, ...] = (STORAGE_SECRET, TRACKING_SECRET)) -> list[dict[str, Any]]:
    """Credentials from the Secrets, optional: a store that needs none runs without them."""
    return [{"secretRef": {"name": name, "optional": True}} for name in names]


def _container(name: str, image: str, args: list[str], resources: dict[str, Any],
               secrets: tuple[str, ...] = (STORAGE_SECRET, TRACKING_SECRET)) -> dict[str, Any]:
    """A pod's container, given only the Secrets it uses (`secrets`)."""
    return {"name": name, "image": image, "imagePullPolicy": "IfNotPresent", "args": args,
            **({"envFrom": _secret_env(secrets)} if secrets else {}), "resources": resources}


def dask_cluster(preset: Preset, target: KubeTarget) -> dict[str, Any]:
    """The operator's DaskCluster: a scheduler, and rollout_workers worker pods of one thread each
    offering the preset's rollout resources."""
    distribution = preset.distribution
    tls = distribution.cluster_tls
    # the scheduler's address given (tls://), not the operator's DASK_SCHEDULER_ADDRESS (tcp://)
    worker_args = ["dask", "worker", *([target.scheduler_address(tls), *_tls_options()] if tls else []),
                   "--name", "$(DASK_WORKER_NAME)", "--nthreads", "1", "--dashboard-address", f":{DASHBOARD_PORT}"]
    if distribution.rollout_resources:
        worker_args += ["--resources", ",".join(f"{k}={v:g}" for k, v in distribution.rollout_resources.items())]
    worker_resources = {"requests": {"cpu": target.worker_cpu, "memory": target.worker_memory},
                        "limits": {"cpu": target.worker_cpu, "memory": target.worker_memory}}
    # the scheduler reads no store: no credential reaches it; the workers write shards, never to MLflow
    scheduler = _container("scheduler", target.image,
                           ["dask", "scheduler", *(["--protocol", "tls", *_tls_options()] if tls else [])],
                           {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "2Gi"}}, secrets=())
    certified = _with_certificate if tls else (lambda pod: pod)
    scheduler["ports"] = [{"name": "tcp-comm", "containerPort": SCHEDULER_PORT, "protocol": "TCP"},
                          {"name": "http-dashboard", "containerPort": DASHBOARD_PORT, "protocol": "TCP"}]
    return {
        "apiVersion": "kubernetes.dask.org/v1",
        "kind": "DaskCluster",
        "metadata": {"name": target.name, "namespace": target.namespace,
                     "labels": {"app.kubernetes.io/part-of": "gymflow"}},
        "spec": {
            "worker": {"replicas": distribution.rollout_workers,
                       "spec": certified({"containers": [_container("worker", target.image, worker_args,
                                                                    worker_resources, secrets=(STORAGE_SECRET,))]})},
            "scheduler": {
                "spec": certified({"containers": [scheduler]}),
                "service": {"type": "ClusterIP", "selector": {"dask.org/cluster-name": target.name,
                                                              "dask.org/component": "scheduler"},
                            "ports": [{"name": "tcp-comm", "protocol": "TCP", "port": SCHEDULER_PORT,
                                       "targetPort": "tcp-comm"},
                                      {"name": "http-dashboard", "protocol": "TCP", "port": DASHBOARD_PORT,
                                       "targetPort": "http-dashboard"}]},
            },
        },
    }


def secrets(target: KubeTarget) -> list[dict[str, Any]]:
    """The two Secrets, with placeholders to fill in (`kubectl apply` them after editing, or make
    them with `kubectl create secret generic ... --from-literal`)."""
    def secret(name: str, data: dict[str, str]) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": name, "namespace": target.namespace}, "stringData": data}

    return [secret(STORAGE_SECRET, {"AWS_ACCESS_KEY_ID": "REPLACE", "AWS_SECRET_ACCESS_KEY": "REPLACE"}),
            secret(TRACKING_SECRET, {"MLFLOW_TRACKING_USERNAME": "REPLACE", "MLFLOW_TRACKING_PASSWORD": "REPLACE"})]


def learner_resources(target: KubeTarget) -> dict[str, Any]:
    limits: dict[str, Any] = {"cpu": target.learner_cpu, "memory": target.learner_memory}
    if target.learner_gpus:
        limits[GPU] = target.learner_gpus
    return {"requests": {"cpu": target.learner_cpu, "memory": target.learner_memory}, "limits": limits}


def work_pool_template(target: KubeTarget, tls: bool = True) -> dict[str, Any]:
    """A Prefect Kubernetes work pool's base job template (`prefect work-pool create --type kubernetes
    --base-job-template`): the flow run's Job, with the learner's resources and the Secrets (`tls`:
    the cluster's certificate too, which its Dask client presents)."""
    container = _container("prefect-job", "{{ image }}", "{{ command }}", learner_resources(target))
    container["env"] = "{{ env }}"
    pod = {"restartPolicy": "Never", "containers": [container]}
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"labels": "{{ labels }}", "namespace": "{{ namespace }}", "generateName": "{{ name }}-"},
        "spec": {"backoffLimit": 0, "ttlSecondsAfterFinished": "{{ finished_job_ttl }}",
                 "template": {"spec": _with_certificate(pod) if tls else pod}},
    }
    variables = {
        "image": {"type": "string", "default": target.image, "description": "gymflow's image (the Dockerfile)"},
        "namespace": {"type": "string", "default": target.namespace},
        "name": {"type": "string", "default": "gymflow"},
        "command": {"type": "array", "items": {"type": "string"},
                    "default": ["prefect", "flow-run", "execute"]},
        "env": {"type": "array", "default": [], "items": {"type": "object"},
                "description": "more environment variables of the flow run's container"},
        "labels": {"type": "object", "default": {"app.kubernetes.io/part-of": "gymflow"}},
        "finished_job_ttl": {"type": "integer", "default": 3600},
    }
    return {
        "job_configuration": {"command": "{{ command }}", "env": "{{ env }}", "labels": "{{ labels }}",
                              "name": "{{ name }}", "namespace": "{{ namespace }}", "job_manifest": job,
                              "stream_output": True},
        "variables": {"type": "object", "properties": variables},
    }


def job_as_the_worker_makes_it(template: dict[str, Any]) -> dict[str, Any]:
    """The template's Job with each placeholder replaced by its variable's default, as the Prefect
    worker fills it for a flow run that sets none."""
    defaults = {name: spec.get("default") for name, spec in template["variables"]["properties"].items()}

    def fill(node: Any) -> Any:
        if isinstance(node, dict):
            return {key: fill(value) for key, value in node.items()}
        if isinstance(node, list):
            return [fill(item) for item in node]
        if isinstance(node, str) and node.startswith("{{ ") and node.endswith(" }}"):
            return defaults[node[3:-3]]
        if isinstance(node, str) and "{{ " in node:
            for name, value in defaults.items():
                node = node.replace(f"{{{{ {name} }}}}", str(value))
        return node

    return fill(copy.deepcopy(template["job_configuration"]["job_manifest"]))


def overrides(preset: Preset, target: KubeTarget) -> dict[str, Any]:
    """The preset fields a run on this cluster sets: the scheduler's Service; storage every pod reaches."""
    if not preset.storage.root.startswith("s3://"):
        raise InvalidPreset("storage.root", f"{preset.storage.root!r} is a folder of one machine; pods need one "
                                            "they all reach: allowed: an s3:// root (--set storage.root=s3://B/P)")
    if not is_tracking_server(preset.tracking.tracking_uri):
        raise InvalidPreset("tracking.tracking_uri", f"{redacted_uri(preset.tracking.tracking_uri)!r} is a store in "
                                                     "the flow's pod, lost with it; allowed: an MLflow server's "
                                                     "http(s):// URL")
    tls = preset.distribution.cluster_tls
    return {"distribution.scheduler_address": target.scheduler_address(tls), "storage.root": preset.storage.root,
            # its password left out: the flow's pod logs in with the MLflow Secret's MLFLOW_TRACKING_PASSWORD
            "tracking.tracking_uri": without_password(preset.tracking.tracking_uri),
            **({"distribution.tls": {field: f"{TLS_MOUNT}/{name}" for field, name in TLS_FILES.items()}}
               if tls else {})}


def check(files: dict[str, Any]) -> None:
    """Each Kubernetes object against the API's schemas at KUBERNETES_VERSION, the DaskCluster
    against the operator's CRD; a failure is one line naming the object and the field."""
    import kubernetes_validate

    objects = [files["daskcluster.yaml"], *files["secrets.yaml"], *([files[TLS_SECRET_FILE]] if TLS_SECRET_FILE in files
                                                                     else []),
               job_as_the_worker_makes_it(files["work-pool-template.json"])]
    for manifest in objects:
        name = f"{manifest['kind']}/{manifest['metadata'].get('name') or manifest['metadata'].get('generateName')}"
        try:
            if manifest["kind"] == "DaskCluster":
                _check_dask_cluster(manifest)
            else:
                kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(part) for part in error.absolute_path)
            raise InvalidPreset(name, f"{path or 'the object'}: {error.message}") from None


def _check_dask_cluster(manifest: dict[str, Any]) -> None:
    import jsonschema
    import kubernetes_validate

    try:
        jsonschema.validate(manifest, dask_cluster_schema())
    except jsonschema.ValidationError as error:
        path = ".".join(str(part) for part in error.absolute_path)
        raise InvalidPreset(f"DaskCluster/{manifest['metadata']['name']}",
                            f"{path}: {error.message} ({DASK_OPERATOR}'s CRD)") from None
    for section in ("worker", "scheduler"):  # its pod specs, as the API's PodSpec (the operator makes pods of them)
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{manifest['metadata']['name']}-{section}"},
               "spec": manifest["spec"][section]["spec"]}
        try:
            kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(part) for part in ["spec", section, *error.absolute_path])  # the pod's spec.
            raise InvalidPreset(f"DaskCluster/{manifest['metadata']['name']}",
                                f"{path}: {error.message}") from None


@functools.cache
def dask_cluster_schema() -> dict[str, Any]:
    """The openAPIV3Schema of the DaskCluster CRD that dask-kubernetes' operator installs (read
    once: its 280 KB of YAML take 0.35 s with PyYAML's Python loader, 0.04 s with libyaml's)."""
    from importlib.resources import files

    crd = yaml.load(files("dask_kubernetes").joinpath(  # noqa: S506 (a safe loader: libyaml's, else Python's)
        "operator/deployment/helm/dask-kubernetes-operator/crds/daskcluster.yaml").read_text(),
        Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


SECRET_FILES = (TLS_SECRET_FILE, "secrets.yaml")


def write(files: dict[str, Any], folder: Path) -> list[Path]:
    """Each file written whole; the Secrets' (the certificate's, and secrets.yaml, which users fill with
    real keys in place) readable by their owner alone from their first byte."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in files.items():
        path = folder / name
        if name.endswith(".json"):
            text = json.dumps(content, indent=2) + "\n"
        elif isinstance(content, list):
            text = yaml.safe_dump_all(content, sort_keys=False)
        else:
            text = yaml.safe_dump(content, sort_keys=False)
        write_whole(path, text, 0o600 if name in SECRET_FILES else 0o644)
        written.append(path)
    return written
