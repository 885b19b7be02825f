"""The improve flow end to end on a tiny budget: a real Prefect API, a Dask LocalCluster of
worker processes, a local storage folder and a real MLflow SQLite store."""

from __future__ import annotations

import json
import os
import time

import pytest
from mlflow.tracking import MlflowClient

from gymflow.flows.improve import improve
from gymflow.tasks.storage.checkpoints import (
    read_checkpoint,
)
from gymflow.tasks.storage.codec import decode_arrays
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage, StorageLocation
from tests.conftest import intruders_let_in, local_overrides, written_files
from tests.stored import check_run_storage

pytestmark = pytest.mark.e2e

def _task_run_names(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    names: list[str] = []
    for _ in range(40):  # task runs reach the API as events, shortly after they finish
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                sort=TaskRunSort.EXPECTED_START_TIME_ASC,
                limit=200,
            )
        names = sorted(run.name for run in runs)
        if any(name.startswith("evaluate") for name in names) and any(name.startswith("train") for name in names):
            return names
        time.sleep(0.25)
    return names


def _check_mlflow(workspace, summary, flow_run_id, algo: str) -> None:
    client = MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}")
    run = client.get_run(summary.mlflow_run_id)
    assert run.info.status == "FINISHED"
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI opens its runs view
    view = json.loads(experiment.tags["mlflow.sharedViewState.gymflow-returns"])  # "Views": the runs by return
    assert "metrics.`summary/best_return`" in json.loads(view["state"])["selectedColumns"]
    shown = [key for key in run.data.tags if not key.startswith("mlflow.")]
    assert shown[0] == "gymflow.return"  # the first tag a run's page shows
    assert run.data.tags["gymflow.return"] == f"{summary.final_return:.4g}, v{summary.delivered_version} delivered"
    assert run.data.params["agent.algo"] == algo
    assert run.data.params["env.id"] == "gymflow.testing.envs:Corridor"
    assert run.data.tags["prefect.flow_run_id"] == str(flow_run_id)
    assert run.data.tags["gymflow.run_id"] == summary.run_id
    for metric in ("rollout/episode_return_mean", "eval/return_mean", "time/env_steps_per_second", "time/policy_version"):
        assert metric in run.data.metrics, metric
    history = client.get_metric_history(run.info.run_id, "time/policy_version")
    assert [m.step for m in history] == sorted(m.step for m in history) and history[-1].step == summary.env_steps
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"preset.yaml", "learning_curve.png", "checkpoint", "videos"} <= artifacts
    onnx_model = run.data.tags["gymflow.onnx_model"].removeprefix("models:/")  # the policy's ONNX graph beside it
    assert sorted(output.model_id for output in run.outputs.model_outputs) == sorted(
        [summary.model_uri.removeprefix("models:/"), onnx_model])
    assert "checkpoint/manifest.json" in {a.path for a in client.list_artifacts(run.info.run_id, "checkpoint")}


def test_ppo_sync_run_lands_checkpoints_shards_and_an_mlflow_run(prefect_api, workspace, tiny_budget):
    state = improve("cartpole-ppo", {**tiny_budget, **local_overrides(workspace)}, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    flow_run_id = state.state_details.flow_run_id
    assert summary.env_steps == 640 and summary.versions_committed == 6
    check_run_storage(Storage(StorageLocation(str(workspace / "data"))), summary, expect_heatup=False)
    _check_mlflow(workspace, summary, flow_run_id, "ppo")
    names = _task_run_names(flow_run_id)
    # the rounds run in `train` stretches of a few seconds each, the first from v0
    starts = sorted(int(n.removeprefix("train-from-v")) for n in names if n.startswith("train"))
    assert starts[0] == 0 and len(set(starts)) == len(starts) and starts[-1] < 5
    assert "evaluate-v5" in names  # the final evaluation
    # rollouts ran in two Dask worker processes, not in the flow's process
    assert len(summary.rollout_processes) == 2
    assert str(os.getpid()) not in {p.split(":")[1] for p in summary.rollout_processes}


def test_dqn_sync_run_heats_up_then_trains(prefect_api, workspace, tiny_budget):
    overrides = {**tiny_budget, "agent.train_steps_per_iteration": 8, "agent.hidden_sizes": [16],
                 "schedule.heatup_env_steps": 128, "storage.checkpoint_replay": True, **local_overrides(workspace)}
    state = improve("cartpole-dqn", overrides, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary.env_steps == 640  # heatup's 128 steps count against the budget
    check_run_storage(Storage(StorageLocation(str(workspace / "data"))), summary, expect_heatup=True)
    _check_mlflow(workspace, summary, state.state_details.flow_run_id, "dqn")
    run = MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}").get_run(summary.mlflow_run_id)
    assert "train/td_loss" in run.data.metrics and "rollout/exploration" in run.data.metrics
    storage = Storage(StorageLocation(str(workspace / "data")))
    final = read_checkpoint(storage, RunLayout(summary.run_id), summary.versions_committed - 1)
    assert decode_arrays(final["replay.npz"])["counters"][2] == summary.env_steps  # every transition inserted


def test_a_run_delivers_its_best_evaluated_version_with_its_checkpoint_though_later_ones_scored_lower(
        prefect_api, workspace, tiny_budget, tmp_path):
    """Each evaluation scores below the one before (Fading), as a collapsing DQN's do: the best, the first,
    is delivered (its policy as the model, its checkpoint beside it, kept past keep_checkpoints 1), and the
    summary names the last version and its score."""
    import json
    from pathlib import Path

    import mlflow

    from gymflow.tasks.storage.checkpoints import POLICY_BLOB, read_policy
    from gymflow.tasks.tracking.models import _use_tracking_uri

    overrides = {**tiny_budget, "env.id": "gymflow.testing.envs:Fading", "agent.train_steps_per_iteration": 8,
                 "agent.hidden_sizes": [16], "schedule.heatup_env_steps": 128, "storage.keep_checkpoints": 1,
                 "tracking.video": "off", **local_overrides(workspace)}
    summary = improve("cartpole-dqn", overrides)
    first, *later = summary.evaluations
    assert len(later) >= 2 and all(row.mean < first.mean for row in later)
    assert summary.delivered_version == first.version < summary.last.version == summary.versions_committed - 1
    assert summary.final_return == first.mean and summary.last.mean_return == later[-1].mean
    storage, uri = Storage(StorageLocation(str(workspace / "data"))), f"sqlite:///{workspace / 'mlflow.db'}"
    with _use_tracking_uri(uri):
        model = Path(mlflow.artifacts.download_artifacts(summary.model_uri, dst_path=str(tmp_path / "model")))
    (policy,) = model.rglob("policy.safetensors")
    assert policy.read_bytes() == read_policy(storage, RunLayout(summary.run_id), first.version, [POLICY_BLOB])[POLICY_BLOB]
    state = MlflowClient(uri).download_artifacts(summary.mlflow_run_id, "checkpoint/loop_state.json", str(tmp_path))
    assert json.loads(Path(state).read_text())["version"] == first.version


def test_bad_input_fails_the_flow_before_anything_is_written(prefect_api, workspace):
    state = improve("cartpole-dqn", {"env.id": "Pendulum-v1", **local_overrides(workspace)}, return_state=True)
    assert state.is_failed()
    assert "agent.algo: dqn supports Discrete action spaces" in state.message
    assert written_files(workspace) == []


# default tier: an unreachable scheduler refused in one line
def test_an_unreachable_scheduler_fails_fast_with_nothing_written(prefect_api, workspace, tiny_budget, monkeypatch):
    import socket

    from gymflow.tasks.cluster import client

    monkeypatch.setattr(client, "CONNECT_TIMEOUT_S", 2)  # Dask's Client tries a refused address again until then (10 s)
    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    overrides = {**tiny_budget, "distribution.scheduler_address": f"tcp://127.0.0.1:{port}", **local_overrides(workspace),
                 "storage.shared": True}
    started = time.monotonic()
    state = improve("cartpole-ppo", overrides, return_state=True)
    assert state.is_failed()
    assert state.message.count("distribution.scheduler_address: no Dask scheduler answered") == 1
    assert time.monotonic() - started < 60
    assert written_files(workspace) == []


def test_a_running_scheduler_address_is_used_instead_of_a_local_cluster(prefect_api, workspace, tiny_budget):
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
        overrides = {**tiny_budget, "schedule.total_env_steps": 256, "distribution.scheduler_address": cluster.scheduler_address,
                     **local_overrides(workspace), "storage.shared": True}  # the workers are on this machine
        summary = improve("cartpole-ppo", overrides)
        with Client(cluster) as client:
            worker_pids = set(client.run(os.getpid).values())
    assert {int(p.split(":")[1]) for p in summary.rollout_processes} == worker_pids


# default tier: the one intruder drill on a run's own LocalCluster (mutual TLS, on by default); the plain-tcp
# run that lets one in is in the long tier
@pytest.mark.parametrize("tls", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_run_s_own_cluster_refuses_clients_without_its_certificate_while_the_run_goes_on(
        prefect_api, workspace, tls, caplog):
    import contextvars
    import threading

    from distributed import Client
    from distributed.scheduler import Scheduler

    from tests.conftest import drill_run

    overrides = {**drill_run(workspace), "distribution.cluster_tls": tls}
    finished: list = []
    context = contextvars.copy_context()  # the test's Prefect API settings, which a new thread would not see
    running = threading.Thread(target=lambda: finished.append(context.run(improve, "cartpole-ppo", overrides)))
    running.start()
    deadline = time.monotonic() + 120
    # both of the run's workers registered (a first one alone: the second may still be shaking hands)
    while not (schedulers := [s for s in list(Scheduler._instances) if len(s.workers) >= 2]) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    (scheduler,) = schedulers
    address = scheduler.address
    let_in = intruders_let_in(address)
    with Client(address, security=scheduler.security, timeout=10) as own:  # the run's own certificates: let in
        assert len(own.scheduler_info()["workers"]) == 2
    assert running.is_alive(), "the run ended before the intruders tried: nothing was tested"
    running.join(timeout=240)
    (summary,) = finished
    assert summary.env_steps == 16384
    plain_said = [r.getMessage() for r in caplog.records if "distribution.cluster_tls: false" in r.getMessage()]
    if tls:
        assert address.startswith("tls://127.0.0.1:") and let_in == [] and plain_said == []
    else:  # plain tcp: anyone who reaches the port runs code as the run's user, and the run said so, once
        assert address.startswith("tcp://127.0.0.1:") and len(let_in) == 1 and len(plain_said) == 1, let_in
