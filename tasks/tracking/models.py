"""Trained policies as MLflow models, the model registry's champion, and scoring policies on
fixed evaluation seeds: what the retraining flow needs."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
from gymnasium import spaces
from mlflow.entities import LoggedModelOutput
from mlflow.environment_variables import MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR
from mlflow.exceptions import MlflowException
from mlflow.models import Model, ModelSignature
from mlflow.tracking._tracking_service.utils import _use_tracking_uri
from mlflow.types import Schema, TensorSpec
from prefect import task
from prefect.cache_policies import NO_CACHE

import gymflow
import gymflow.agents
import gymflow.envs
import gymflow.presets
import gymflow.tasks.lake
import gymflow.tasks.storage
from gymflow.agents.match import MatchResult, play_match
from gymflow.agents.rollout import evaluate
from gymflow.envs.parts import Part, lay_out, observation_parts, unflatten_parts
from gymflow.envs.vector import make_vector_env, observation_dtype
from gymflow.errors import UnusableWarmStart
from gymflow.presets.model import EnvConfig
from gymflow.tasks.lake.serving_log import MODEL_CONFIG, OWN_USE
from gymflow.tasks.tracking.store import tracking_client
from gymflow.tasks.tracking.tracker import Tracker, patiently

MODEL_ARTIFACT = "policy"
CHAMPION = "champion"
_MODEL_CODE = str(Path(__file__).with_name("policy_model.py"))
_GLOBAL_TRACKING_URI = threading.Lock()
_logger = logging.getLogger(__name__)


def torch_requirement(version: str) -> str:
    """The model's torch: the one that saved it, as the package index names it (a local build's
    `+cu130` or `+cpu` dropped), not the version gymflow's CPU machines pin."""
    return f"torch=={version.split('+')[0]}"


def model_requirements() -> list[str]:
    """A logged model's pip requirements; asked as it is logged, when torch is loaded already
    (importing it with this module would load it with the flows: test_layering)."""
    import torch

    return [torch_requirement(torch.__version__), "gymnasium>=1.1", "numpy", "pydantic>=2.6", "pyyaml",
            "safetensors", "mlflow>=3"]


@dataclass(frozen=True)
class ModelRef:
    name: str
    version: str
    run_id: str

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"


@dataclass(frozen=True)
class PolicyModel:
    """What the logged policy model is made of."""

    policy: bytes  # the policy's safetensors
    preset_yaml: bytes
    observation_space: spaces.Space
    action_space: spaces.Space
    params: Mapping[str, str]  # the run's preset, flattened
    memory_size: int | None = None  # a recurrent policy's: its memory [2, N, memory_size] goes in and out
    policy_name: str | None = None  # one of an agent group's separate policies alone (agent.policies); None: all
    label: str = MODEL_ARTIFACT  # what the model is named after: the run's preset and version (cartpole-ppo-v12)
    linked: tuple[str, ...] = ("summary/", "eval/")  # the run's metrics at its step shown with it, by prefix

    @property
    def name(self) -> str:
        """The logged model's name: its label, and `-<name>` for one of several policies."""
        return self.label if self.policy_name is None else f"{self.label}-{self.policy_name}"

    def input_example(self) -> np.ndarray | dict[str, np.ndarray]:
        if observation_parts(self.observation_space):  # a Dict observation's parts, by name
            return {part.key: np.zeros((1, *part.shape), _part_dtype(part))
                    for part in observation_parts(self.observation_space)}
        observations = np.zeros((1, *self.observation_space.shape), dtype=observation_dtype(self.observation_space))
        if self.memory_size is None:
            return observations
        return {OBSERVATIONS: observations, MEMORY: np.zeros((2, 1, self.memory_size), np.float32)}


OBSERVATIONS, ACTIONS, MEMORY = "observations", "actions", "memory"  # a recurrent policy model's named tensors


def log_policy_model(tracker: Tracker, model: PolicyModel, step: int) -> str:
    """Log a policy as an MLflow 3 logged model named `policy` (pyfunc, with an input signature),
    output of the run at `step`: the run's metrics at that step are linked to it. The model
    carries gymflow's agents, envs and presets code, so loading it needs no gymflow install.
    Returns its URI, models:/<model id>."""
    # The model is made the run's output at `step`, and the metrics at `step` linked to it, here,
    # from what the tracker logged: MLflow's Model.log(run_id=) reads the history of each of the
    # run's metrics to find them, one request a key (3 s of a CartPole run's end through a tracking
    # server). A step the tracker did not log last (a resumed run's) is left to MLflow.
    linked = tracker.metrics_at(step)
    shown = [metric for metric in linked if metric.key.startswith(model.linked)]
    logged = tracker.client.create_logged_model(tracker.experiment_id, name=model.name,
                                                source_run_id=tracker.run_id, params=dict(model.params),
                                                model_type="gymflow-policy")
    with (tempfile.TemporaryDirectory() as folder, _global_tracking_uri(tracker.tracking_uri), _no_progress_bars(),
          _logged_without_mlflows_slow_checks()):
        patiently(  # a login refused for a moment (a failover), a server out within its budget: tried again
            Model.log,
            outage=tracker.outage,
            artifact_path=None,
            name=model.name,
            flavor=mlflow.pyfunc,
            model_id=logged.model_id,
            run_id=None if linked else tracker.run_id,
            step=step,
            **_pyfunc_parts(model, folder),
        )
    if linked:
        tracker.client.log_outputs(tracker.run_id, [LoggedModelOutput(logged.model_id, step=step)])
        tracker.link_metrics(shown, logged.model_id)
    return f"models:/{logged.model_id}"


def save_policy_model(model: PolicyModel, path: str) -> None:
    """The policy's pyfunc model saved in a folder, as `log_policy_model` logs it: what
    `mlflow models serve -m PATH` serves."""
    with tempfile.TemporaryDirectory() as folder, _no_progress_bars(), _logged_without_mlflows_slow_checks():
        mlflow.pyfunc.save_model(path, **_pyfunc_parts(model, folder))


def _pyfunc_parts(model: PolicyModel, folder: str) -> dict[str, Any]:
    """The pyfunc model's code, artifacts (written under `folder`), requirements and signature."""
    Path(folder, "policy.safetensors").write_bytes(model.policy)
    Path(folder, "preset.yaml").write_bytes(model.preset_yaml)
    Path(folder, "label.txt").write_text(model.name)  # what its logged decisions name the policy that acted
    artifacts = {"policy": os.path.join(folder, "policy.safetensors"),
                 "preset": os.path.join(folder, "preset.yaml"), "label": os.path.join(folder, "label.txt")}
    if model.policy_name is not None:  # which of the network's policies acts
        Path(folder, "policy_name.txt").write_text(model.policy_name)
        artifacts["policy_name"] = os.path.join(folder, "policy_name.txt")
    return {"python_model": _MODEL_CODE, "artifacts": artifacts, "code_paths": [_model_code(folder)],
            "pip_requirements": model_requirements(), "input_example": model.input_example(),
            "signature": policy_signature(model.observation_space, model.action_space, model.memory_size),
            "model_config": MODEL_CONFIG}


def log_onnx_policy(tracker: Tracker, model: PolicyModel, graph: bytes, step: int) -> str:
    """Log a policy's ONNX graph (agents/export.py) as an MLflow logged model of the onnx flavor named
    `<policy model>-onnx`, output of the run at `step` beside the pyfunc one: served by
    `mlflow models serve` or any ONNX runtime, without torch or gymflow. Returns its URI."""
    import onnx

    from gymflow.agents.export import NEXT_MEMORY  # the graph's memory out (every algorithm: imported here only)

    logged = tracker.client.create_logged_model(tracker.experiment_id, name=f"{model.name}-onnx",
                                                source_run_id=tracker.run_id, params=dict(model.params),
                                                model_type="gymflow-policy-onnx")
    inputs, outputs = _observation_specs(model.observation_space), [_actions_spec(model.action_space, ACTIONS)]
    example = {spec.name: np.zeros((1, *spec.shape[1:]), spec.type) for spec in inputs}
    if model.memory_size is not None:  # a recurrent policy's memory: [2, batch, H] in, and after the step out
        inputs.append(TensorSpec(np.dtype(np.float32), (2, -1, model.memory_size), MEMORY))
        outputs.append(TensorSpec(np.dtype(np.float32), (2, -1, model.memory_size), NEXT_MEMORY))
        example[MEMORY] = np.zeros((2, 1, model.memory_size), np.float32)
    signature = ModelSignature(inputs=Schema(inputs), outputs=Schema(outputs))
    with _global_tracking_uri(tracker.tracking_uri), _no_progress_bars(), _logged_without_mlflows_slow_checks():
        patiently(mlflow.onnx.log_model, outage=tracker.outage, onnx_model=onnx.load_from_string(graph),
                  name=f"{model.name}-onnx", model_id=logged.model_id, step=step, signature=signature,
                  input_example=example, save_as_external_data=False,
                  # said, not inferred: MLflow's inference loads the model in a subprocess (7 s of a run's end)
                  pip_requirements=mlflow.onnx.get_default_pip_requirements())
    tracker.client.log_outputs(tracker.run_id, [LoggedModelOutput(logged.model_id, step=step)])
    return f"models:/{logged.model_id}"


@contextmanager
def _global_tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's model logging and its registry reach logged models through its process-global
    tracking URI: set it for the call, one thread at a time (a sweep runs its runs in threads)."""
    with _GLOBAL_TRACKING_URI, _use_tracking_uri(uri):
        yield


@contextmanager
def _logged_without_mlflows_slow_checks() -> Iterator[None]:
    """While a policy model is logged (under `_GLOBAL_TRACKING_URI`), two checks MLflow makes of
    every model, which only warn, and took 1.6 s of each run's end on the 2-core VM:
    - that this environment satisfies the model's pip requirements: looked up here by each
      one's distribution name (`unsatisfied_requirements`), with the same warning, instead of
      first mapping every installed distribution's modules (importlib's `packages_distributions`
      reads every RECORD file: 0.9 s);
    - that the model, loaded back, predicts its input example (0.7 s): not made; gymflow's
      model code is its own, and its tests load, predict and serve logged models, this check
      included (tests/test_what_users_see.py).
    """
    from mlflow.models import utils
    from mlflow.utils import environment

    replaced = {(environment, "warn_dependency_requirement_mismatches"): _warn_of_unsatisfied_requirements,
                (utils, "_validate_serving_input"): _not_validated}
    originals = {place: getattr(*place) for place in replaced}
    for (module, name), replacement in replaced.items():
        setattr(module, name, replacement)
    try:
        yield
    finally:
        for (module, name), original in originals.items():
            setattr(module, name, original)


def _not_validated(model_uri: str, serving_input: object) -> None:
    return None


def unsatisfied_requirements(requirements: Iterable[str]) -> list[str]:
    """Which pip requirements this environment does not satisfy, each as MLflow words it
    (`name (current: VERSION, required: REQUIREMENT)`); lines that are not a requirement by name
    (`-c constraints.txt`, a path, a URL) and requirements whose marker excludes this
    environment are skipped, as MLflow skips them."""
    from packaging.requirements import InvalidRequirement, Requirement

    unsatisfied = []
    for line in requirements:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if requirement.marker and not requirement.marker.evaluate():
            continue
        installed = _installed_version(requirement.name)
        if installed is None or not requirement.specifier.contains(installed):
            unsatisfied.append(f"{requirement.name} (current: {installed or 'uninstalled'}, required: {line})")
    return unsatisfied


def _installed_version(name: str) -> str | None:
    """The installed version of distribution `name`; MLflow's as its module says it, as MLflow's own
    check reads it (whichever distribution installed it: `mlflow`, or `mlflow-skinny` alone, as gymflow
    needs it)."""
    from importlib import metadata

    if name.lower() == "mlflow":
        return mlflow.__version__
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _warn_of_unsatisfied_requirements(requirements: list[str]) -> None:
    if unsatisfied := unsatisfied_requirements(requirements):
        _logger.warning("Detected one or more mismatches between the model's dependencies and the current Python "
                        "environment:\n - %s", "\n - ".join(unsatisfied))


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """MLflow draws a progress bar for every artifact it downloads (while logging a model, and a
    model downloaded: 84 lines in a run's log)."""
    previous = os.environ.get(MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.name)
    os.environ[MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.name] = "false"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.name, None)
        else:
            os.environ[MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.name] = previous


def policy_signature(observation_space: spaces.Space, action_space: spaces.Space, memory_size: int | None = None
                     ) -> ModelSignature:
    """A batch of observations in, a batch of greedy actions out; for a recurrent policy, named
    tensors, its memory going in beside the observations and out beside the actions."""
    recurrent = memory_size is not None
    if observation_parts(observation_space):  # named tensors, one a Dict observation's part (never recurrent)
        parts = [TensorSpec(np.dtype(_part_dtype(part)), (-1, *part.shape), part.key)
                 for part in observation_parts(observation_space)]
        return ModelSignature(inputs=Schema(parts), outputs=Schema([_actions_spec(action_space, None)]))
    observations = TensorSpec(np.dtype(observation_dtype(observation_space)), (-1, *observation_space.shape),
                              OBSERVATIONS if recurrent else None)
    actions = _actions_spec(action_space, ACTIONS if recurrent else None)
    if memory_size is None:
        return ModelSignature(inputs=Schema([observations]), outputs=Schema([actions]))
    memory = TensorSpec(np.dtype(np.float32), (2, -1, memory_size), name=MEMORY)
    return ModelSignature(inputs=Schema([observations, memory]), outputs=Schema([actions, memory]))


def _observation_specs(observation_space: spaces.Space) -> list[TensorSpec]:
    """The ONNX graph's observation inputs, named: `observations`, or one a Dict observation's part."""
    parts = observation_parts(observation_space)
    if parts:
        return [TensorSpec(np.dtype(_part_dtype(part)), (-1, *part.shape), part.key) for part in parts]
    return [TensorSpec(np.dtype(observation_dtype(observation_space)), (-1, *observation_space.shape), OBSERVATIONS)]


def _actions_spec(action_space: spaces.Space, name: str | None) -> TensorSpec:
    if isinstance(action_space, spaces.Discrete):
        return TensorSpec(np.dtype(np.int64), (-1,), name)
    return TensorSpec(np.dtype(np.float32), (-1, *action_space.shape), name)


def _part_dtype(part: Part) -> type:
    """How a caller passes a Dict observation's part: images as uint8, vectors as float32."""
    return np.uint8 if part.image else np.float32


def _model_code(folder: str) -> str:
    """A `gymflow` package holding what loading a policy needs (agents, envs, presets) and what its
    decision log writes with (storage), copied under `folder`: the model carries it, so loading it
    needs no gymflow install."""
    package = Path(folder, "code", "gymflow")
    package.mkdir(parents=True)
    for module in ("__init__.py", "errors.py", "commands.py", "outage.py"):
        shutil.copy(Path(gymflow.__file__).with_name(module), package / module)
    for subpackage in (gymflow.agents, gymflow.envs, gymflow.presets, gymflow.tasks.storage):
        name = subpackage.__name__.removeprefix("gymflow.").replace(".", "/")
        shutil.copytree(Path(subpackage.__file__).parent, package / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    lake = Path(gymflow.tasks.lake.__file__).parent
    shutil.copy(Path(gymflow.tasks.__file__), package / "tasks" / "__init__.py")
    (package / "tasks" / "lake").mkdir()
    for module in ("__init__.py", "decision_log.py", "serving_log.py"):
        shutil.copy(lake / module, package / "tasks" / "lake" / module)
    return str(package)


def read_warm_start(source: str, tracking_uri: str) -> dict:
    """Policy weights to start from: a policy.safetensors path, or an MLflow model URI
    (models:/name@alias, models:/name/3, models:/<model id>) of a gymflow policy."""
    from safetensors.torch import load_file  # torch: not for a flow that only reads the registry

    try:
        if source.startswith(("models:/", "runs:/")):  # the whole model: a path inside a models:/<model id>
            # the URI reads as a registered model's name and stage; a logged model is looked up through the
            # global tracking URI
            with tempfile.TemporaryDirectory() as folder, _global_tracking_uri(tracking_uri), _no_progress_bars():
                local = mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=folder,
                                                            tracking_uri=tracking_uri)
                return load_file(Path(local, "artifacts", "policy.safetensors"))
        return load_file(source)
    except (OSError, MlflowException) as error:
        raise UnusableWarmStart("warm_start", f"cannot read a gymflow policy from {source!r}: {error}") from None


@task(name="find-champion", cache_policy=NO_CACHE)
def find_champion(tracking_uri: str, name: str) -> ModelRef | None:
    client = tracking_client(tracking_uri)
    try:
        version = client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None
    return ModelRef(name, str(version.version), version.run_id)


@task(name="register-challenger", cache_policy=NO_CACHE)
def register_challenger(tracking_uri: str, name: str, run_id: str, model_uri: str) -> ModelRef:
    """Register a run's logged policy model (models:/<model id>) as a new version of `name`."""
    client = tracking_client(tracking_uri)
    _registered(client, name, "gymflow policies; alias 'champion' is the one in use.")
    model_id = model_uri.removeprefix("models:/")
    with _global_tracking_uri(tracking_uri):  # the registry looks the logged model up through it
        version = client.create_model_version(name, model_uri, run_id=run_id, model_id=model_id)
    return ModelRef(name, str(version.version), run_id)


@task(name="score-policy", task_run_name="score-{model.name}-v{model.version}", cache_policy=NO_CACHE)
def score_policy(tracking_uri: str, model: ModelRef, env: EnvConfig, episodes: int, seed: int) -> list[float]:
    """Greedy returns of a registered policy, loaded through MLflow, one episode per env; the same
    (env_id, episodes, seed) give the same episodes to every policy scored."""
    with tempfile.TemporaryDirectory() as folder:
        policy = _load_policy(tracking_uri, model, folder)
        envs = make_vector_env(env.id, dict(env.kwargs), episodes, seed, env.preprocessing().evaluation())
        envs.reset()
        returns = evaluate(policy, envs).returns
        envs.close()
    return [float(r) for r in returns]


@task(name="play-match", task_run_name="match-v{challenger.version}-v{champion.version}", cache_policy=NO_CACHE)
def match_policies(tracking_uri: str, challenger: ModelRef, champion: ModelRef, env: EnvConfig, games: int,
                   seed: int) -> MatchResult:
    """The challenger against the champion on a two-player env, both loaded through MLflow:
    `games` seeded games, sides swapped every other game (agents/match.py)."""
    with tempfile.TemporaryDirectory() as folder:
        first = _load_policy(tracking_uri, challenger, os.path.join(folder, "challenger"))
        second = _load_policy(tracking_uri, champion, os.path.join(folder, "champion"))
        played = make_vector_env(env.id, dict(env.kwargs), games, seed, env.preprocessing().evaluation())
        try:
            return play_match(first, second, played)
        finally:
            played.close()


def _load_policy(tracking_uri: str, model: ModelRef, folder: str) -> _PredictingPolicy:
    with _global_tracking_uri(tracking_uri), _no_progress_bars():  # a models:/ URI is resolved through the
        # process-global registry
        local = mlflow.artifacts.download_artifacts(artifact_uri=model.uri, dst_path=folder, tracking_uri=tracking_uri)
    return _PredictingPolicy(mlflow.pyfunc.load_model(local, model_config=OWN_USE))


def greedy_actions(tracking_uri: str, model: ModelRef, observations: np.ndarray) -> np.ndarray:
    """The registered policy's greedy actions on `observations`, as its pyfunc model serves them."""
    with _global_tracking_uri(tracking_uri):
        policy = mlflow.pyfunc.load_model(model.uri, model_config=OWN_USE)
    return np.asarray(policy.predict(observations.astype(np.float32)))


def mean_return(returns: list[float]) -> float:
    return float(np.mean(returns))


@task(name="register-onnx-graph", cache_policy=NO_CACHE)
def register_onnx_sibling(tracking_uri: str, name: str, run_id: str) -> ModelRef | None:
    """Register the run's ONNX graph (its tag `gymflow.onnx_model`) as a new version of `<name>-onnx`,
    so that `models:/<name>-onnx@champion` is the champion's graph once promoted; None where the run
    logged none (a policy that cannot be a graph)."""
    client = tracking_client(tracking_uri)
    uri = client.get_run(run_id).data.tags.get("gymflow.onnx_model")
    if uri is None:
        return None
    sibling = f"{name}{ONNX_SIBLING}"
    _registered(client, sibling, f"the ONNX graphs of {name}'s policies; alias 'champion' is the champion's.")
    with _global_tracking_uri(tracking_uri):
        version = client.create_model_version(sibling, uri, run_id=run_id, model_id=uri.removeprefix("models:/"))
    return ModelRef(sibling, str(version.version), run_id)


ONNX_SIBLING = "-onnx"  # the registered model of a policy model's ONNX graphs: `<name>-onnx`


def _registered(client: mlflow.MlflowClient, name: str, description: str) -> None:
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description=description)


@task(name="promote", cache_policy=NO_CACHE)
def promote(tracking_uri: str, model: ModelRef, graph: ModelRef | None = None) -> None:
    """`model` is the champion from now on, and `graph` (its ONNX sibling's version) with it; a
    champion without a graph takes the sibling's alias away (it named an earlier champion's)."""
    client = tracking_client(tracking_uri)
    client.set_registered_model_alias(model.name, CHAMPION, model.version)
    if graph is not None:
        client.set_registered_model_alias(graph.name, CHAMPION, graph.version)
        return
    try:
        client.delete_registered_model_alias(f"{model.name}{ONNX_SIBLING}", CHAMPION)
    except MlflowException:  # no sibling, or no alias on it: nothing names an earlier graph
        pass


class _PredictingPolicy:
    """A logged policy model acting in a vector env; a recurrent one's memory carried from step to
    step through its input and output, and emptied where an episode ends."""

    def __init__(self, model):
        self.model = model
        inputs = model.metadata.get_input_schema()
        recurrent = inputs is not None and MEMORY in (inputs.input_names() or [])
        self.memory_size = inputs.inputs[1].shape[-1] if recurrent else None
        self.memory: np.ndarray | None = None
        named = inputs is not None and inputs.has_input_names() and not recurrent  # a Dict observation's parts
        self.parts = lay_out([(spec.name, tuple(spec.shape[1:]), spec.type == np.dtype(np.uint8))
                              for spec in inputs.inputs]) if named else ()

    def act(self, obs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        if self.parts:
            return np.asarray(self.model.predict(self._by_part(obs))), np.zeros(len(obs), dtype=np.float32)
        if self.memory_size is None:
            return np.asarray(self.model.predict(obs)), np.zeros(len(obs), dtype=np.float32)
        memory = self.memory if self.memory is not None else np.zeros((2, len(obs), self.memory_size), np.float32)
        out = self.model.predict({OBSERVATIONS: obs, MEMORY: memory})
        self.memory = np.array(out[MEMORY], dtype=np.float32)
        return np.asarray(out[ACTIONS]), np.zeros(len(obs), dtype=np.float32)

    def episodes_ended(self, envs) -> None:
        if self.memory is not None and len(envs):
            self.memory[:, list(envs)] = 0.0

    def _by_part(self, obs: np.ndarray) -> dict[str, np.ndarray]:
        """Flat observations back into the Dict's parts (the signature's order is the flat array's)."""
        return unflatten_parts(self.parts, obs)

