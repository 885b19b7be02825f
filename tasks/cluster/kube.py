"""What a team applies to run gymflow on Kubernetes, made from a preset (`gymflow kube`):

- a `DaskCluster` for the dask-kubernetes operator: the scheduler behind its Service, and one
  worker pod per rollout worker, with the resources the preset's rollouts ask for;
- a Prefect Kubernetes work pool's base job template, whose Job runs the improve and retraining
  flows (the learner: its CPUs, memory and GPU);
- the Secrets both read their credentials from (S3 storage, the MLflow server), as templates;
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
from gymflow.presets.model import Preset
from gymflow.presets.redaction import redacted_uri
from gymflow.tasks.tracking.servers import is_tracking_server

KUBERNETES_VERSION = "1.33.0"  # the API the manifests are checked against
DASK_OPERATOR = "dask-kubernetes 2026.3.0"  # whose DaskCluster CRD they are checked against
STORAGE_SECRET, TRACKING_SECRET = "gymflow-storage", "gymflow-tracking"
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

    @property
    def scheduler_address(self) -> str:
        return f"tcp://{self.name}-scheduler.{self.namespace}.svc.cluster.local:{SCHEDULER_PORT}"


def manifests(preset: Preset, target: KubeTarget) -> dict[str, Any]:
    """file name -> content: each a dict (YAML or JSON) or a list of dicts (several YAML documents)."""
    return {
        "daskcluster.yaml": dask_cluster(preset, target),
        "secrets.yaml": secrets(target),
        "work-pool-template.json": work_pool_template(target),
        "overrides.yaml": overrides(preset, target),
    }


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
    worker_args = ["dask", "worker", "--name", "$(DASK_WORKER_NAME)", "--nthreads", "1", "--dashboard-address",
                   f":{DASHBOARD_PORT}"]
    if distribution.rollout_resources:
        worker_args += ["--resources", ",".join(f"{k}={v:g}" for k, v in distribution.rollout_resources.items())]
    worker_resources = {"requests": {"cpu": target.worker_cpu, "memory": target.worker_memory},
                        "limits": {"cpu": target.worker_cpu, "memory": target.worker_memory}}
    # the scheduler reads no store: no credential reaches it; the workers write shards, never to MLflow
    scheduler = _container("scheduler", target.image, ["dask", "scheduler"],
                           {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "2Gi"}}, secrets=())
    scheduler["ports"] = [{"name": "tcp-comm", "containerPort": SCHEDULER_PORT, "protocol": "TCP"},
                          {"name": "http-dashboard", "containerPort": DASHBOARD_PORT, "protocol": "TCP"}]
    return {
        "apiVersion": "kubernetes.dask.org/v1",
        "kind": "DaskCluster",
        "metadata": {"name": target.name, "namespace": target.namespace,
                     "labels": {"app.kubernetes.io/part-of": "gymflow"}},
        "spec": {
            "worker": {"replicas": distribution.rollout_workers,
                       "spec": {"containers": [_container("worker", target.image, worker_args, worker_resources,
                                                          secrets=(STORAGE_SECRET,))]}},
            "scheduler": {
                "spec": {"containers": [scheduler]},
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


def work_pool_template(target: KubeTarget) -> dict[str, Any]:
    """A Prefect Kubernetes work pool's base job template (`prefect work-pool create --type kubernetes
    --base-job-template`): the flow run's Job, with the learner's resources and the Secrets."""
    container = _container("prefect-job", "{{ image }}", "{{ command }}", learner_resources(target))
    container["env"] = "{{ env }}"
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"labels": "{{ labels }}", "namespace": "{{ namespace }}", "generateName": "{{ name }}-"},
        "spec": {"backoffLimit": 0, "ttlSecondsAfterFinished": "{{ finished_job_ttl }}",
                 "template": {"spec": {"restartPolicy": "Never", "containers": [container]}}},
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
    return {"distribution.scheduler_address": target.scheduler_address, "storage.root": preset.storage.root,
            "tracking.tracking_uri": redacted_uri(preset.tracking.tracking_uri)}


def check(files: dict[str, Any]) -> None:
    """Each Kubernetes object against the API's schemas at KUBERNETES_VERSION, the DaskCluster
    against the operator's CRD; a failure is one line naming the object and the field."""
    import kubernetes_validate

    objects = [files["daskcluster.yaml"], *files["secrets.yaml"],
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


def write(files: dict[str, Any], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in files.items():
        path = folder / name
        if name.endswith(".json"):
            path.write_text(json.dumps(content, indent=2) + "\n")
        elif isinstance(content, list):
            path.write_text(yaml.safe_dump_all(content, sort_keys=False))
        else:
            path.write_text(yaml.safe_dump(content, sort_keys=False))
        written.append(path)
    return written
