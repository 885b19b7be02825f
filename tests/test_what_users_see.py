"""What a person sees of a run: its stages and evaluations as Prefect task runs, its progress,
evaluations and summary as Prefect artifacts; in MLflow the policy as a logged model with a
signature, the run's description, source and overrides, and films of evaluation episodes; the
policy served by `mlflow models serve`; and the command line's output. One DQN run (heatup,
periodic evaluations, a film of each) under a real Prefect API, Dask worker processes and a
real MLflow store serves most tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import imageio_ffmpeg
import mlflow
import numpy as np
import pytest
import requests
from mlflow.models import Model
from mlflow.tracking import MlflowClient
from mlflow.tracking._tracking_service.utils import _use_tracking_uri

from gymflow.envs.make import make_env
from gymflow.envs.seeding import derive_seed
from gymflow.flows.improve import improve
from gymflow.tasks.training.evaluation import Standing
from gymflow.tasks.training.summary import RunSummary
from tests.serving import served

pytestmark = pytest.mark.e2e

OVERRIDES = {
    "env.id": "gymflow.testing.envs:Corridor",
    "agent.train_steps_per_iteration": 8,
    "agent.hidden_sizes": [16],
    "distribution.rollout_workers": 2,
    "distribution.envs_per_worker": 4,
    "schedule.rollout_steps_per_env": 16,
    "schedule.heatup_env_steps": 128,
    "schedule.total_env_steps": 640,
    "schedule.evaluate_every_env_steps": 256,
    "schedule.evaluation_episodes": 4,
    "schedule.target_return": None,
    "tracking.video": "every_evaluation",
}


@dataclass(frozen=True)
class FinishedRun:
    folder: Path
    summary: RunSummary
    flow_run_id: str

    @property
    def tracking_uri(self) -> str:
        return f"sqlite:///{self.folder / 'mlflow.db'}"

    def mlflow(self) -> MlflowClient:
        return MlflowClient(self.tracking_uri)


@pytest.fixture(scope="module")
def finished_run(prefect_api, tmp_path_factory) -> FinishedRun:
    folder = tmp_path_factory.mktemp("run")
    overrides = {**OVERRIDES, "storage.root": str(folder / "data"), "tracking.tracking_uri": f"sqlite:///{folder / 'mlflow.db'}",
                 "tracking.artifact_location": str(folder / "mlruns")}  # not MLflow's default, ./mlruns where pytest runs
    state = improve("cartpole-dqn", overrides, return_state=True)
    assert state.is_completed(), state.message
    return FinishedRun(folder, state.result(), str(state.state_details.flow_run_id))


def _task_run_names(flow_run_id: str, evaluations: int) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    names: list[str] = []
    for _ in range(40):  # task runs reach the API as events, shortly after they finish
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                                         limit=200)
        names = sorted(run.name for run in runs)
        if sum(name.startswith("evaluate") for name in names) >= evaluations:
            return names
        time.sleep(0.25)
    return names


def _artifacts(flow_run_id: str) -> dict[str, list]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    by_key: dict[str, list] = {}
    for artifact in found:
        by_key.setdefault(artifact.key or artifact.type, []).append(artifact)
    return by_key


def test_a_run_stopped_early_ends_its_progress_at_100_percent_with_what_it_delivered(prefect_api):
    """A DQN run that reached its target at 40% of its budget used to leave its progress artifact at
    40%, reading `delivering v153 to MLflow`."""
    import logging

    from prefect import flow
    from prefect.context import get_run_context

    from gymflow.tasks.tracking.artifacts import ProgressArtifact
    from gymflow.tasks.tracking.progress import ProgressLog

    @flow
    def stopped_early() -> str:
        progress = ProgressLog(logging.getLogger("stopped-early"), 100_072, views=[ProgressArtifact("early", 0.0)])
        progress.update(40_424, "delivering v153 to MLflow: its ONNX graph", force=True)
        progress.finish(40_424, "v153 delivered: evaluation return 500.0, target 475 reached")
        return str(get_run_context().flow_run.id)

    (artifact,) = _artifacts(stopped_early())["improve-progress"]
    assert float(artifact.data) == 100.0
    assert artifact.description == ("gymflow run early: 40,424/100,072 env steps (stopped early), v153 delivered: "
                                    "evaluation return 500.0, target 475 reached")


def test_heatup_training_and_every_evaluation_are_task_runs_named_by_what_they_do(finished_run):
    names = _task_run_names(finished_run.flow_run_id, len(finished_run.summary.evaluations))
    assert names.count("heatup") == 1
    assert any(name.startswith("train-from-v") for name in names)
    # the periodic evaluations and the final one, each named by the version it scores
    scored = [row.version for row in finished_run.summary.evaluations]
    assert len(scored) >= 3 and scored[-1] == finished_run.summary.versions_committed - 1
    assert sorted(name for name in names if name.startswith("evaluate")) == sorted(f"evaluate-v{v}" for v in scored)


def test_the_flow_run_has_progress_evaluations_and_a_summary_with_its_curve(finished_run):
    artifacts = _artifacts(finished_run.flow_run_id)
    (progress,) = artifacts["improve-progress"]
    assert progress.type == "progress" and float(progress.data) == 100.0
    assert "640/640 env steps" in progress.description
    # it ends at the delivered version, not mid-delivery ("delivering v3 to MLflow: its ONNX graph")
    assert f"v{finished_run.summary.delivered_version} delivered: evaluation return " in progress.description
    assert "delivering" not in progress.description, progress.description
    (table,) = artifacts["improve-evaluations"]
    rows = table.data if isinstance(table.data, list) else __import__("json").loads(table.data)
    assert [row["env steps"] for row in rows] == [row.env_steps for row in finished_run.summary.evaluations]
    assert set(rows[0]) == {"env steps", "version", "mean return", "min", "max"}
    (summary,) = artifacts["improve-summary"]
    assert finished_run.summary.mlflow_run_id in summary.data
    assert "![learning curve](data:image/png;base64," in summary.data
    assert f"videos/evaluation-v{finished_run.summary.versions_committed - 1:06d}.mp4" in summary.data


def _greedy_actions(run: FinishedRun, observations: np.ndarray) -> np.ndarray:
    """The delivered version's greedy actions, computed as the rollout workers compute them."""
    from gymflow.agents.algorithms import algorithm_of
    from gymflow.presets.load import load_preset
    from gymflow.tasks.storage.checkpoints import POLICY_BLOB, read_policy
    from gymflow.tasks.storage.codec import decode_tensors
    from gymflow.tasks.storage.layout import RunLayout
    from gymflow.tasks.storage.objects import Storage, StorageLocation

    preset = load_preset(str(run.folder / "data" / "runs" / run.summary.run_id / "preset.yaml"))
    blobs = read_policy(Storage(StorageLocation(str(run.folder / "data"))), RunLayout(run.summary.run_id),
                        run.summary.delivered_version, [POLICY_BLOB])
    env = make_env(preset.env.id, preset.env.kwargs)
    algorithm = algorithm_of(preset.agent)
    network = algorithm.network(preset.agent, env.observation_space, env.action_space)
    network.load_state_dict(decode_tensors(blobs[POLICY_BLOB]))
    network.eval()
    return algorithm.policy(network, preset.agent, 0.0, 0).act(observations, explore=False)[0]


def _observations(count: int = 16) -> np.ndarray:
    env = make_env("gymflow.testing.envs:Corridor")
    return np.stack([env.reset(seed=seed)[0] for seed in range(count)]).astype(np.float32)


def test_the_policy_is_a_logged_model_with_a_signature_and_the_run_s_final_metrics(finished_run):
    client, summary = finished_run.mlflow(), finished_run.summary
    run = client.get_run(summary.mlflow_run_id)
    models = {model.name: model for model in client.search_logged_models(experiment_ids=[run.info.experiment_id])}
    named = f"corridor-dqn-v{summary.delivered_version}"  # after the run's task (its env, its algorithm), the version
    assert sorted(models) == [named, f"{named}-onnx"]  # the pyfunc, and its ONNX graph beside it
    model = models[named]
    assert summary.model_uri == f"models:/{model.model_id}" and model.source_run_id == run.info.run_id
    assert model.status == "READY"
    shown = {metric.key for metric in model.metrics}  # the run's summary, and its last evaluation where it is this one's
    assert "summary/final_return" in shown and not any(key.startswith(("rollout/", "system/")) for key in shown)
    assert ("eval/return_mean" in shown) == (summary.last is None)
    assert model.params["agent.algo"] == "dqn"
    assert sorted(output.model_id for output in run.outputs.model_outputs) == sorted(m.model_id for m in models.values())
    with _use_tracking_uri(finished_run.tracking_uri):
        loaded = mlflow.pyfunc.load_model(summary.model_uri)  # by its model id
    inputs = loaded.metadata.signature.inputs.to_dict()
    assert inputs == [{"type": "tensor", "tensor-spec": {"dtype": "float32", "shape": (-1, 2)}}]
    observations = _observations()
    np.testing.assert_array_equal(loaded.predict(observations), _greedy_actions(finished_run, observations))
    with _use_tracking_uri(finished_run.tracking_uri):  # what MLflow checks as it logs a model, which gymflow skips
        model_folder = mlflow.artifacts.download_artifacts(summary.model_uri)
    example = Model.load(model_folder).load_input_example(model_folder)
    assert example.shape == (1, 2)
    np.testing.assert_array_equal(loaded.predict(example), _greedy_actions(finished_run, example))


def test_the_policy_s_onnx_graph_answers_the_pyfunc_s_actions_in_mlflow_and_in_onnx_runtime_alone(finished_run):
    import onnxruntime

    run = finished_run.mlflow().get_run(finished_run.summary.mlflow_run_id)
    onnx_uri = run.data.tags["gymflow.onnx_model"]
    observations = np.concatenate([_observations(), np.random.default_rng(0).normal(0, 2, (984, 2)).astype(np.float32)])
    expected = _greedy_actions(finished_run, observations)
    with _use_tracking_uri(finished_run.tracking_uri):
        served_by_mlflow = mlflow.pyfunc.load_model(onnx_uri)  # MLflow's onnx flavor: ONNX Runtime, no torch
        model_folder = Path(mlflow.artifacts.download_artifacts(onnx_uri))
    assert served_by_mlflow.metadata.signature.inputs.to_dict() == [
        {"type": "tensor", "name": "observations", "tensor-spec": {"dtype": "float32", "shape": (-1, 2)}}]
    np.testing.assert_array_equal(served_by_mlflow.predict({"observations": observations})["actions"], expected)
    session = onnxruntime.InferenceSession(str(model_folder / "model.onnx"), providers=["CPUExecutionProvider"])
    (actions,) = session.run(["actions"], {"observations": observations})  # the file a team copies anywhere
    assert actions.dtype == np.int64
    np.testing.assert_array_equal(actions, expected)


def test_export_policy_writes_the_delivered_policy_as_an_onnx_file_or_says_why_not(finished_run, tmp_path, capsys):
    import onnxruntime

    from gymflow.flows.cli import main

    run_id, root = finished_run.summary.run_id, str(finished_run.folder / "data")
    target = tmp_path / "policies" / "policy.onnx"
    assert main(["export-policy", run_id, "--root", root, "--to", str(target)]) == 0
    said = capsys.readouterr().out
    assert f"exported v{finished_run.summary.delivered_version} of run {run_id} (the version the run delivered)" in said
    observations = np.random.default_rng(1).normal(0, 2, (1000, 2)).astype(np.float32)
    (actions,) = onnxruntime.InferenceSession(str(target)).run(["actions"], {"observations": observations})
    np.testing.assert_array_equal(actions, _greedy_actions(finished_run, observations))
    elsewhere = tmp_path / "never.onnx"
    assert main(["export-policy", run_id, "--root", root, "--to", str(elsewhere), "--version", "9999"]) == 2
    assert capsys.readouterr().err.startswith(f"gymflow: error: --version: run {run_id} keeps no policy v9999; allowed: ")
    assert not elsewhere.exists()


def test_the_mlflow_run_is_described_and_says_its_source_and_what_it_overrode(finished_run):
    tags = finished_run.mlflow().get_run(finished_run.summary.mlflow_run_id).data.tags
    assert "final evaluation return" in tags["mlflow.note.content"]  # the description in the UI
    assert finished_run.summary.model_uri in tags["mlflow.note.content"]
    assert tags["mlflow.source.name"] and tags["mlflow.user"]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    if commit.returncode == 0:  # the tests run from a checkout
        assert tags["mlflow.source.git.commit"] == commit.stdout.strip()
    overrides = tags["gymflow.overrides"]
    assert "schedule.total_env_steps=640" in overrides and 'tracking.video="every_evaluation"' in overrides
    assert "agent.hidden_sizes=[16]" in overrides


def test_every_evaluation_is_filmed_and_logged_where_mlflow_plays_it(finished_run, tmp_path):
    client, summary = finished_run.mlflow(), finished_run.summary
    films = {a.path for a in client.list_artifacts(summary.mlflow_run_id, "videos")}
    assert films == {f"videos/evaluation-v{row.version:06d}.mp4" for row in summary.evaluations}
    final = f"videos/evaluation-v{summary.delivered_version:06d}.mp4"
    local = client.download_artifacts(summary.mlflow_run_id, final, str(tmp_path))
    frames, _ = imageio_ffmpeg.count_frames_and_secs(local)
    size = next(imageio_ffmpeg.read_frames(local))["size"]
    # the film is the first evaluation episode of the final policy: its first frame and one per step
    env = make_env("gymflow.testing.envs:Corridor")
    obs, _ = env.reset(seed=derive_seed(derive_seed(0, "evaluation", 0), 0, 0))
    steps, done = 0, False
    while not done:
        obs, _, terminated, truncated, _ = env.step(int(_greedy_actions(finished_run, obs[None])[0]))
        steps, done = steps + 1, terminated or truncated
    assert (frames, size) == (steps + 1, (16 * 8, 16))


def test_a_registered_policy_served_by_mlflow_answers_with_the_flow_s_greedy_actions(finished_run):
    from gymflow.tasks.tracking.models import register_challenger

    model = register_challenger.fn(finished_run.tracking_uri, "gymflow-served", finished_run.summary.mlflow_run_id,
                                   finished_run.summary.model_uri)
    with served(model.uri, finished_run.tracking_uri, finished_run.folder) as invocations:
        observations = _observations()
        answer = requests.post(invocations, json={"inputs": observations.tolist()}, timeout=30)
        assert answer.ok, answer.text
        np.testing.assert_array_equal(np.asarray(answer.json()["predictions"]),
                                      _greedy_actions(finished_run, observations))


# default tier (one of its 25 slowest): `gymflow run` as a command, with its own temporary Prefect API
def test_the_command_line_trains_an_env_from_the_working_folder_with_no_warnings(tmp_path):
    (tmp_path / "my_corridor.py").write_text("from gymflow.testing.envs import Corridor\n\n\nclass MyCorridor(Corridor):\n"
                                            "    pass\n")
    settings = {**{key: value for key, value in OVERRIDES.items() if not key.startswith(("agent.", "schedule.heatup"))},
                "env.id": "my_corridor:MyCorridor", "tracking.video": "final"}
    args = [arg for key, value in settings.items() for arg in ("--set", f"{key}={_yaml(value)}")]
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_") or key == "PREFECT_HOME"}
    done = subprocess.run([sys.executable, "-m", "gymflow.flows.cli", "run", "cartpole-ppo", "--quiet", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert " ended; v" in output and " delivered: evaluation return " in output  # no target: neither reached nor missed
    assert "━" not in output and "env steps (100%)" in done.stderr  # piped: the log lines tell progress, no bar
    assert "Warning" not in output and "WARNING" not in output and "warn(" not in output, output[-3000:]
    assert "database tables" not in output and "Validating input example" not in output, output[-3000:]
    # Prefect's engine lines go to the run's log file (and the API), not to the terminal
    assert "Finished in state" not in output and "Beginning flow run" not in output, output[-3000:]
    (log,) = (tmp_path / "gymflow-logs").glob("mycorridor-ppo-*.log")  # the run is named after the user's env
    assert f"the whole log is in gymflow-logs/{log.name}" in done.stderr and log.stem in done.stdout
    assert "Finished in state Completed()" in log.read_text() and " done: " in log.read_text()
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("gymflow").experiment_id])
    assert run.data.params["env.id"] == "my_corridor:MyCorridor"
    assert any(a.path.startswith("videos/") for a in client.list_artifacts(run.info.run_id, "videos"))


def _yaml(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


@pytest.mark.slow  # long tier: the command line's own temporary API stays in (test_the_command_line_trains_an_env...)
def test_a_temporary_prefect_api_that_fails_to_start_is_started_again(tmp_path, monkeypatch):
    """What two runs started at once can meet: Prefect's SQLite database locked while the server
    migrates it, and the server exits (status 3). Made for real: the database is held locked by
    another connection until the first server has given up."""
    import sqlite3
    import threading

    import httpx

    from gymflow.flows.stopping import TemporaryApi

    database = tmp_path / "prefect.db"
    monkeypatch.setenv("PREFECT_API_DATABASE_CONNECTION_URL", f"sqlite+aiosqlite:///{database}")
    holder = sqlite3.connect(database, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")
    api = TemporaryApi()
    first = api.process

    def release_once_refused() -> None:
        first.wait(120)
        holder.execute("ROLLBACK")

    threading.Thread(target=release_once_refused, daemon=True).start()
    try:
        api.wait_ready()
        assert first.returncode == 3 and api.process is not first
        assert httpx.get(f"{api.url}/health", timeout=5).status_code == 200
    finally:
        api.stop()
        holder.close()


def test_the_temporary_prefect_api_asks_itself_its_first_question_once_it_listens(monkeypatch):
    """flows/api_server.py: the warm-up waits while nothing listens (uvicorn listens only after
    the app has started), asks once something does, and gives up at its deadline."""
    import http.server
    import socket
    import threading

    from gymflow.flows import api_server

    asked: list[str] = []

    class Recording(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    bound = socket.socket()
    bound.bind(("127.0.0.1", 0))  # bound, not yet listening: connections are refused
    port = bound.getsockname()[1]
    answered: list[bool] = []
    warming = threading.Thread(target=lambda: answered.append(api_server.warm_up(port)))
    warming.start()
    time.sleep(0.3)
    assert asked == [] and warming.is_alive()
    server = http.server.HTTPServer(("127.0.0.1", port), Recording, bind_and_activate=False)
    server.socket.close()
    server.socket = bound
    server.server_activate()  # listens now
    threading.Thread(target=server.handle_request, daemon=True).start()
    warming.join(10)
    server.server_close()
    assert answered == [True] and asked == [api_server.WARM_UP_PATH]

    nobody = socket.socket()
    nobody.bind(("127.0.0.1", 0))
    monkeypatch.setattr(api_server, "WARM_UP_DEADLINE_S", 0.3)
    assert api_server.warm_up(nobody.getsockname()[1]) is False
    nobody.close()


def test_a_logged_model_s_requirements_are_checked_as_mlflow_checks_them_without_its_module_map():
    """tasks/tracking/models.py replaces MLflow's requirement check while logging a model (its
    map of every installed distribution's modules took 0.9 s of each run's end), and skips the
    serving check that test_the_policy_is_a_logged_model_with_a_signature... makes: the same
    mismatches, in MLflow's words, on requirements that hold, fail, name nothing installed,
    or are not requirements at all."""
    from mlflow.models import utils
    from mlflow.utils import environment
    from mlflow.utils.requirements_utils import _check_requirement_satisfied

    from gymflow.tasks.tracking import models

    requirements = [*models.model_requirements(), "numpy<1", "gymnasium>=99", "no-such-distribution-gymflow==1.0",
                    "-c constraints.txt", 'numpy<1; python_version < "3"']
    mlflows = [str(info) for line in requirements if (info := _check_requirement_satisfied(line)) is not None]
    assert models.unsatisfied_requirements(requirements) == mlflows
    assert len(mlflows) == 3 and all(name in " ".join(mlflows) for name in ("numpy", "gymnasium", "no-such"))
    assert models.unsatisfied_requirements(models.model_requirements()) == []  # gymflow's own hold here
    # a model saved on the GPU machines' torch asks for that torch, not the CPU machines' pin
    assert models.torch_requirement("2.11.0+cu130") == "torch==2.11.0"
    assert models.torch_requirement("2.13.0") == "torch==2.13.0"
    # the names MLflow calls as it logs a model, replaced only inside
    checking, validating = environment.warn_dependency_requirement_mismatches, utils._validate_serving_input
    with models._logged_without_mlflows_slow_checks():
        assert environment.warn_dependency_requirement_mismatches is models._warn_of_unsatisfied_requirements
        assert utils._validate_serving_input is models._not_validated
    assert (environment.warn_dependency_requirement_mismatches, utils._validate_serving_input) == (checking, validating)


def test_the_temporary_prefect_api_answers_without_nagle_s_delay():
    """uvicorn takes the socket the run hands it as a Unix socket and so leaves Nagle's algorithm
    on its TCP connections (every answer held ~40 ms): flows/api_server.py sets TCP_NODELAY on the
    listening socket, and the connections it accepts inherit it."""
    import socket

    from gymflow.flows import api_server

    def accepted_no_delay(fixed: bool) -> int:
        with socket.socket() as listening:
            listening.bind(("127.0.0.1", 0))
            listening.listen()
            if fixed:
                api_server.no_delay(listening.fileno())
            with socket.create_connection(listening.getsockname()):
                served, _ = listening.accept()
                with served:
                    return served.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)

    assert accepted_no_delay(fixed=False) == 0 and accepted_no_delay(fixed=True) != 0


def test_the_console_shows_gymflow_s_lines_warnings_and_errors_and_not_prefect_s_engine_lines():
    import logging

    import prefect

    from gymflow.flows.console import OnlyWhatAPersonReads

    def record(name: str, level: int, path: str) -> logging.LogRecord:
        return logging.LogRecord(name, level, path, 1, "a line", None, None)

    engine = str(Path(prefect.__file__).parent / "task_engine.py")
    ours = str(Path(__file__).resolve().parents[1] / "tasks" / "training" / "run.py")
    shown = OnlyWhatAPersonReads().filter
    assert not shown(record("prefect.task_runs", logging.INFO, engine))  # "Finished in state Completed()"
    assert shown(record("prefect.task_runs", logging.INFO, ours))  # a stage line gymflow logs through Prefect
    assert shown(record("prefect.flow_runs", logging.WARNING, engine)) and shown(record("gymflow.x", logging.INFO, ours))
    assert not shown(record("distributed.scheduler", logging.INFO, "/x/distributed/scheduler.py"))


@pytest.mark.parametrize(("summary", "says"), [
    (RunSummary("cartpole-ppo-1", "abc", "file:///data/runs/cartpole-ppo-1", env_steps=20480, versions_committed=11,
                delivered_version=10, model_uri="models:/m-1", final_return=500.0, best_return=500.0, solved=True,
                wall_seconds=12.34, work_seconds=10.0, rollout_processes=frozenset({"vm:1", "vm:2"}),
                target_return=475.0),
     "20,480 env steps in 12.3 s (19% orchestration); v10 delivered: evaluation return 500.0 (the best), target "
     "475 reached; model models:/m-1; MLflow run abc; stored at file:///data/runs/cartpole-ppo-1"),
    (RunSummary("cartpole-dqn-1", "abc", "file:///d", env_steps=50000, delivered_version=7, model_uri="models:/m-3",
                final_return=478.1, best_return=478.1, wall_seconds=10.0, work_seconds=10.0,
                last=Standing(231, 50000, 41.6)),
     "50,000 env steps in 10.0 s (0% orchestration); v7 delivered: evaluation return 478.1 (the best; the last "
     "version, v231, scored 41.6); model models:/m-3; MLflow run abc; stored at file:///d"),
    (RunSummary("appo-1", "def", "s3://b/runs/appo-1", env_steps=150528, delivered_version=8, model_uri="models:/m-2",
                final_return=1.0, best_return=2.0, wall_seconds=22.5, work_seconds=22.2, shards_inserted=147,
                policy_lag_mean=1.1836, policy_lag_max=2),
     "150,528 env steps in 22.5 s (1% orchestration); v8 delivered: evaluation return 1.0, best 2.0; 147 chunks "
     "learned from, 0 dropped past the lag bound, 0 after the stop (lag 1.18 on average, 2 at most); model "
     "models:/m-2; MLflow run def; stored at s3://b/runs/appo-1"),
    (RunSummary("iql-1", "ghi", "file:///d", gradient_steps=3000, wall_seconds=5.0, work_seconds=5.0),
     "3,000 gradient steps in 5.0 s (0% orchestration); no model logged; MLflow run ghi; stored at file:///d"),
])
def test_the_done_line_says_the_outcome_in_words_not_a_python_repr(summary, says):
    from gymflow.tasks.training.delivery import describe

    assert describe(summary) == says


def test_the_progress_line_shows_a_training_return_only_where_it_means_something():
    from gymflow.tasks.training.state import LoopState
    from gymflow.tasks.training.summary import EvaluationRow, RunRecorder

    state = LoopState.start(2, 100)
    recorder = RunRecorder(tracker=None, progress=None, budget=None)
    assert recorder._status(state) == "v0"  # no episode ended yet (an offline run never has one): not "return nan"
    recorder._episode_return = 12.5
    assert recorder._status(state) == "v0 return 12.5"
    recorder.evaluations.append(EvaluationRow(0, 20.0, 10.0, 30.0, 0))
    assert recorder._status(state) == "v0 return 12.5 eval 20.0"
    recorder.shows_training_return = False  # a competitive game's sides cancel out: "return 0.0" says nothing
    assert recorder._status(state) == "v0 eval 20.0"


def _flow_run_log(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    with get_client(sync_client=True) as client:
        return [log.message for log in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))]


@pytest.mark.parametrize(("flow_name", "parameters", "says"), [
    ("improve", {"overrides": {"agent.lr": -1}}, "agent.lr: Input should be greater than 0 (got -1)"),
    ("retrain", {"overrides": {"agent": {"gamma": 2}}}, "agent.gamma: Input should be less than or equal to 1 (got 2)"),
    ("monitor", {"evaluation_episodes": 0}, "evaluation_episodes: Input should be greater than or equal to 1 (got 0)"),
])
def test_a_flow_parameter_out_of_bounds_is_refused_in_one_line_in_the_runs_state_and_its_log(
        prefect_api, flow_name, parameters, says):
    """Prefect checks a run's parameters before its body: what it refused reached no log a person
    reads (`prefect deployment run --watch` showed only 'Failed'), and its state message was a list."""
    import importlib

    from gymflow.errors import InvalidPreset
    from gymflow.flows.parameters import PARAMETERS_REFUSED

    flow = getattr(importlib.import_module(f"gymflow.flows.{flow_name}"), flow_name)
    state = flow(**parameters, return_state=True)
    assert state.is_failed() and state.message == f"{PARAMETERS_REFUSED} InvalidPreset: {says}"
    logged = [line for line in _flow_run_log(state.state_details.flow_run_id) if line.startswith("gymflow:")]
    assert logged == [f"gymflow: error: {says} (the run did not start)"]
    with pytest.raises(InvalidPreset, match="^" + says.replace("(", r"\(").replace(")", r"\)") + "$"):
        flow(**parameters)  # a flow called in-process raises gymflow's error itself


# What a team's serving machine reads the ONNX model with: nothing of gymflow, torch or the env
_SERVE_ALONE = """
import sys, numpy as np, mlflow, onnxruntime
for absent in ("torch", "gymflow", "gymnasium"):
    try:
        __import__(absent)
    except ImportError:
        continue
    sys.exit(f"{absent} is installed beside mlflow and onnxruntime")
tracking_uri, model_uri, folder = sys.argv[1:4]
mlflow.set_tracking_uri(tracking_uri)
observations = np.load(f"{folder}/observations.npy")
served = mlflow.pyfunc.load_model(model_uri)
np.save(f"{folder}/mlflow_actions.npy", served.predict({"observations": observations})["actions"])
model_file = mlflow.artifacts.download_artifacts(model_uri) + "/model.onnx"
session = onnxruntime.InferenceSession(model_file, providers=["CPUExecutionProvider"])
np.save(f"{folder}/session_actions.npy", session.run(["actions"], {"observations": observations})[0])
"""


@pytest.mark.slow
def test_the_onnx_model_serves_the_pyfunc_s_actions_where_only_mlflow_and_onnxruntime_are_installed(
        finished_run, tmp_path):
    """A virtual environment of mlflow (this one's version) and onnxruntime from the package index, nothing
    else asked for: the run's ONNX model loaded from its MLflow store there, and served over HTTP by its
    `mlflow models serve`, answers the pyfunc's actions."""
    import onnxruntime

    venv = tmp_path / "serving"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", f"mlflow=={mlflow.__version__}",
                    f"onnxruntime=={onnxruntime.__version__}"], check=True, timeout=1500)
    observations = np.concatenate([_observations(), np.random.default_rng(1).normal(0, 2, (984, 2)).astype(np.float32)])
    np.save(tmp_path / "observations.npy", observations)
    run = finished_run.mlflow().get_run(finished_run.summary.mlflow_run_id)
    done = subprocess.run([str(python), "-c", _SERVE_ALONE, finished_run.tracking_uri, run.data.tags["gymflow.onnx_model"],
                           str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={key: value for key, value in os.environ.items() if key != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-3000:]
    expected = _greedy_actions(finished_run, observations)
    np.testing.assert_array_equal(np.load(tmp_path / "mlflow_actions.npy"), expected)
    np.testing.assert_array_equal(np.load(tmp_path / "session_actions.npy"), expected)
    with served(run.data.tags["gymflow.onnx_model"], finished_run.tracking_uri, tmp_path, python) as invocations:
        answer = requests.post(invocations, json={"inputs": {"observations": observations.tolist()}}, timeout=60)
    assert answer.ok, answer.text[-2000:]
    np.testing.assert_array_equal(np.asarray(answer.json()["predictions"]["actions"]), expected)
