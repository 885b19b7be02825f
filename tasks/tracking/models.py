"""Trained policies as MLflow models, the model registry's champion, and scoring policies on
fixed evaluation seeds: what the retraining flow needs."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlflow
import numpy as np
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from prefect import task
from prefect.cache_policies import NO_CACHE
from safetensors.torch import load_file

import gymflow
import gymflow.agents
import gymflow.envs
import gymflow.presets
from gymflow.agents.rollout import evaluate
from gymflow.envs.vector import SeededVectorEnv
from gymflow.errors import UnusableWarmStart
from gymflow.tasks.tracking.tracker import Tracker

MODEL_ARTIFACT = "policy"
CHAMPION = "champion"
_MODEL_CODE = str(Path(__file__).with_name("policy_model.py"))
_REQUIREMENTS = ["torch==2.13.0", "gymnasium>=1.1", "numpy", "pydantic>=2.6", "pyyaml", "safetensors", "mlflow>=3"]


@dataclass(frozen=True)
class ModelRef:
    name: str
    version: str
    run_id: str

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"


def log_policy_model(tracker: Tracker, policy: bytes, preset_yaml: bytes) -> str:
    """Log a policy as an MLflow pyfunc model in the run's `policy/` artifacts; the model carries
    gymflow's agents, envs and presets code, so loading it needs no gymflow install."""
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "policy.safetensors").write_bytes(policy)
        Path(folder, "preset.yaml").write_bytes(preset_yaml)
        model_dir = os.path.join(folder, "model")
        mlflow.pyfunc.save_model(
            path=model_dir,
            python_model=_MODEL_CODE,
            artifacts={"policy": os.path.join(folder, "policy.safetensors"),
                       "preset": os.path.join(folder, "preset.yaml")},
            code_paths=[_model_code(folder)],
            pip_requirements=_REQUIREMENTS,
        )
        tracker.log_artifact(model_dir, MODEL_ARTIFACT)
    return f"runs:/{tracker.run_id}/{MODEL_ARTIFACT}"


def _model_code(folder: str) -> str:
    """A `gymflow` package holding what loading a policy needs (agents, envs, presets), copied
    under `folder`: the model carries it, so loading it needs no gymflow install."""
    package = Path(folder, "code", "gymflow")
    package.mkdir(parents=True)
    for module in ("__init__.py", "errors.py"):
        shutil.copy(Path(gymflow.__file__).with_name(module), package / module)
    for subpackage in (gymflow.agents, gymflow.envs, gymflow.presets):
        name = subpackage.__name__.rpartition(".")[2]
        shutil.copytree(Path(subpackage.__file__).parent, package / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return str(package)


def read_warm_start(source: str, tracking_uri: str) -> dict:
    """Policy weights to start from: a policy.safetensors path, or an MLflow model URI
    (models:/name@alias, models:/name/3, runs:/id/policy) of a gymflow policy."""
    try:
        if source.startswith(("models:/", "runs:/")):
            with tempfile.TemporaryDirectory() as folder:
                local = mlflow.artifacts.download_artifacts(artifact_uri=f"{source}/artifacts/policy.safetensors",
                                                            dst_path=folder, tracking_uri=tracking_uri)
                return load_file(local)
        return load_file(source)
    except (OSError, MlflowException) as error:
        raise UnusableWarmStart("warm_start", f"cannot read a gymflow policy from {source!r}: {error}") from None


@task(name="find-champion", cache_policy=NO_CACHE)
def find_champion(tracking_uri: str, name: str) -> ModelRef | None:
    client = MlflowClient(tracking_uri)
    try:
        version = client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None
    return ModelRef(name, str(version.version), version.run_id)


@task(name="register-challenger", cache_policy=NO_CACHE)
def register_challenger(tracking_uri: str, name: str, run_id: str) -> ModelRef:
    client = MlflowClient(tracking_uri)
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="gymflow policies; alias 'champion' is the one in use.")
    version = client.create_model_version(name, f"runs:/{run_id}/{MODEL_ARTIFACT}", run_id=run_id)
    return ModelRef(name, str(version.version), run_id)


@task(name="score-policy", task_run_name="score-{model.name}-v{model.version}", cache_policy=NO_CACHE)
def score_policy(
    tracking_uri: str, model: ModelRef, env_id: str, env_kwargs: dict, episodes: int, seed: int
) -> list[float]:
    """Greedy returns of a registered policy, loaded through MLflow, one episode per env; the same
    (env_id, episodes, seed) give the same episodes to every policy scored."""
    with tempfile.TemporaryDirectory() as folder:
        local = mlflow.artifacts.download_artifacts(artifact_uri=model.uri, dst_path=folder, tracking_uri=tracking_uri)
        loaded = mlflow.pyfunc.load_model(local)
        env = SeededVectorEnv(env_id, env_kwargs, episodes, seed)
        env.reset()
        returns = evaluate(_PredictingPolicy(loaded), env).returns
        env.close()
    return [float(r) for r in returns]


def mean_return(returns: list[float]) -> float:
    return float(np.mean(returns))


@task(name="promote", cache_policy=NO_CACHE)
def promote(tracking_uri: str, model: ModelRef) -> None:
    MlflowClient(tracking_uri).set_registered_model_alias(model.name, CHAMPION, model.version)


class _PredictingPolicy:
    def __init__(self, model):
        self.model = model

    def act(self, obs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.model.predict(obs)), np.zeros(len(obs), dtype=np.float32)
