"""Several learning ranks (distribution.learners): gloo on CPU, two ranks, real processes.

Every rank holds the learner and draws the same minibatches; each computes its share of their
rows' gradients, averaged before every step. So two ranks learn what one learner learns (within
float rounding, the sums grouped differently), and the same seed and number of ranks give the
same weights every time (SYNC)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import types

import numpy as np
import psutil
import pytest
from mlflow.tracking import MlflowClient
from safetensors.numpy import load

from gymflow.agents.data_parallel import Ranks
from gymflow.errors import InvalidPreset
from gymflow.flows.improve import improve
from gymflow.presets.validate import resolve_experiment
from gymflow.tasks.storage.checkpoints import read_checkpoint
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage, StorageLocation
from gymflow.tasks.training.learner_ranks import LearnerRanks
from gymflow.testing.rollouts import random_rollout
from tests.conftest import local_overrides
from tests.stored import newest_published

LONG = pytest.mark.slow
RANK_MODULE = "gymflow.tasks.training.learner_rank"
# cartpole-ppo's agent on the test corridor, in the flow's process (single): 10 rounds of 128 steps, 4 epochs of 4
# minibatches each, 160 updates
PPO_RUN = {"env.id": "gymflow.testing.envs:Corridor", "distribution.mode": "single",
           "distribution.rollout_workers": 2, "distribution.envs_per_worker": 4, "schedule.rollout_steps_per_env": 16,
           "schedule.total_env_steps": 1280, "schedule.evaluate_every_env_steps": 640,
           "schedule.evaluation_episodes": 4, "schedule.target_return": None, "agent.minibatch_size": 32,
           "agent.epochs": 4, "agent.normalize_observations": True}
# pendulum-sac's agent, SYNC in the flow's process: 128 steps of heatup, then 8 rounds of 64 steps and 32 updates
SAC_RUN = {"env.id": "Pendulum-v1", "distribution.mode": "single", "distribution.rollout_workers": 1,
           "distribution.envs_per_worker": 4, "schedule.rollout_steps_per_env": 16, "schedule.heatup_env_steps": 128,
           "schedule.total_env_steps": 640, "schedule.evaluate_every_env_steps": 100_000,
           "schedule.evaluation_episodes": 2, "schedule.target_return": None, "agent.batch_size": 64,
           "agent.train_steps_per_iteration": 32, "agent.hidden_sizes": [32, 32]}
TOLERANCE = 1e-4  # PPO's measured 2e-7 after 160 updates


def _final_policy(root, summary) -> dict[str, np.ndarray]:
    storage = Storage(StorageLocation(str(root)))
    blob = read_checkpoint(storage, RunLayout(summary.run_id), summary.versions_committed - 1,
                           ["policy.safetensors"])["policy.safetensors"]
    return load(blob)


def _trained(preset: str, run: dict, workspace, name: str, learners: int):
    root = workspace / name
    summary = improve(preset, {**run, **local_overrides(workspace), "storage.root": str(root),
                               "distribution.learners": learners})
    return summary, _final_policy(root, summary)


def _largest_difference(one: dict[str, np.ndarray], other: dict[str, np.ndarray]) -> float:
    assert one.keys() == other.keys()
    return max(float(np.abs(one[key] - other[key]).max()) for key in one if one[key].size)


def test_two_ranks_learn_what_one_learner_learns_and_the_same_every_time(prefect_api, workspace, caplog):
    with caplog.at_level(logging.INFO):
        _, alone = _trained("cartpole-ppo", PPO_RUN, workspace, "one", 1)
        summary, two = _trained("cartpole-ppo", PPO_RUN, workspace, "two", 2)
    assert any("learning on 2 ranks (cpu, cpu)" in record.getMessage() for record in caplog.records)
    recorded = MlflowClient(local_overrides(workspace)["tracking.tracking_uri"]).get_run(summary.mlflow_run_id).data
    assert "| learner | 2 ranks, on cpu, cpu |" in recorded.tags["mlflow.note.content"]  # the run's summary
    assert [key for key in recorded.metrics  # the other rank's process, beside the flow's
            if key.startswith("system/learner-") and key.endswith("/process_cpu_percentage")]
    _, again = _trained("cartpole-ppo", PPO_RUN, workspace, "two-again", 2)
    assert all(np.array_equal(two[key], again[key]) for key in two)  # exact for a number of ranks
    assert 0 < _largest_difference(alone, two) <= TOLERANCE  # the ranks' sums, grouped otherwise than one's
    assert not [child for child in psutil.Process().children(recursive=True) if RANK_MODULE in child.cmdline()]


# the other replay learners on SAC_RUN's schedule: TD3 on Pendulum, DQN on the test corridor
TD3_RUN = {**SAC_RUN, "env.id": "Pendulum-v1"}
DQN_RUN = {**SAC_RUN, "env.id": "gymflow.testing.envs:Corridor", "agent.hidden_sizes": [32]}


@LONG
@pytest.mark.parametrize(("preset", "run"), [("pendulum-sac", SAC_RUN), ("hopper-td3", TD3_RUN),
                                             ("cartpole-dqn", DQN_RUN)], ids=["sac", "td3", "dqn"])
def test_two_replay_learner_ranks_learn_what_one_learner_learns(preset, run, prefect_api, workspace):
    _, alone = _trained(preset, run, workspace, "one", 1)
    _, two = _trained(preset, run, workspace, "two", 2)
    _, again = _trained(preset, run, workspace, "two-again", 2)
    assert all(np.array_equal(two[key], again[key]) for key in two)
    assert 0 < _largest_difference(alone, two) <= TOLERANCE


def _kill_a_rank_mid_call(root, killed: list[int], stop: threading.Event) -> None:
    """Once the run has published v3, SIGKILL the first learning rank seen computing (its CPU time
    moving: inside a call, not waiting for the next)."""
    while not stop.is_set() and newest_published(root) < 3:
        time.sleep(0.01)
    while not stop.is_set():
        for child in psutil.Process().children(recursive=True):
            try:
                if RANK_MODULE not in " ".join(child.cmdline()):
                    continue
                before = child.cpu_times().user
                time.sleep(0.02)
                if child.cpu_times().user > before:
                    os.kill(child.pid, signal.SIGKILL)
                    killed.append(child.pid)
                    return
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.005)


@LONG
def test_a_rank_killed_mid_round_is_started_again_and_the_run_ends_with_the_clean_run_s_weights(
        prefect_api, workspace, caplog):
    heavy = {**PPO_RUN, "agent.epochs": 30}  # learning is most of each round: a kill lands inside a call
    _, clean = _trained("cartpole-ppo", heavy, workspace, "clean", 2)
    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(target=_kill_a_rank_mid_call, args=(workspace / "killed", killed, stop), daemon=True)
    killer.start()
    try:
        with caplog.at_level(logging.WARNING):
            _, survived = _trained("cartpole-ppo", heavy, workspace, "killed", 2)
    finally:
        stop.set()
        killer.join()
    assert killed, "no learning rank was seen computing, so none was killed"
    lost = [record.getMessage() for record in caplog.records if "learner rank 1 lost during its learn" in
            record.getMessage()]
    assert len(lost) == 1, lost
    assert all(np.array_equal(clean[key], survived[key]) for key in clean)


@LONG
def test_a_checkpoint_written_by_two_ranks_resumes_on_one(prefect_api, workspace):
    from tests.killing import kill_flow_midway

    run = {**PPO_RUN, "distribution.mode": "sync", **local_overrides(workspace)}
    _, clean = _trained("cartpole-ppo", run, workspace, "clean", 2)
    root = workspace / "killed"
    kill_flow_midway("cartpole-ppo", {**run, "storage.root": str(root), "distribution.learners": 2}, root,
                     workspace / "killed.log", kill_at=4)
    assert "learning on 2 ranks" in (workspace / "killed.log").read_text()
    (run_dir,) = (root / "runs").iterdir()
    resumed = improve("cartpole-ppo", {"storage.root": str(root), "distribution.learners": 1},
                      resume=run_dir.name)
    assert resumed.env_steps == run["schedule.total_env_steps"]
    assert _largest_difference(clean, _final_policy(root, resumed)) <= TOLERANCE


@LONG
def test_cartpole_ppo_on_two_ranks_solves_as_the_preset_does(prefect_api, workspace):
    summary = improve("cartpole-ppo", {**local_overrides(workspace), "distribution.learners": 2})
    assert summary.final_return >= 475  # the preset's target, CartPole-v1's solved


@pytest.mark.parametrize(("changes", "said"), [
    ({"agent.algo": "bc"}, "distribution.learners: bc learns in one process for now"),
    ({"agent.recurrent": 16}, "distribution.learners: a recurrent policy's sequences are not shared out"),
    ({"agent.minibatch_size": 1}, "distribution.learners: each of 2 ranks takes a share of agent.minibatch_size's 1"),
])
def test_what_ranks_cannot_share_out_is_refused_in_one_line(changes, said):
    with pytest.raises(InvalidPreset) as refused:
        resolve_experiment("cartpole-ppo", {"distribution.learners": 2, **changes})
    assert str(refused.value).startswith(said), str(refused.value)
    assert "\n" not in str(refused.value)


def test_ranks_that_auto_puts_on_gpus_this_machine_lacks_are_refused_in_one_line(monkeypatch):
    """A pixel preset's learner goes to the GPU under auto; two ranks there need two (one GPU faked:
    this machine may have none)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(InvalidPreset) as refused:
        resolve_experiment("catch-ppo", {"distribution.learners": 2})
    assert str(refused.value) == ("distribution.learners: 2 ranks from cuda need a GPU each; this machine has 1 CUDA "
                                  "device(s): allowed: up to 1; or learner_device: cpu for ranks on the CPU")
    assert resolve_experiment("catch-ppo", {"distribution.learners": 2, "distribution.learner_device": "cpu"})


def _learnt_by(preset: str, changes: dict, ranks: int, rollouts: list, metrics: list | None = None
               ) -> dict[str, np.ndarray]:
    """The policy weights a run's learner of `preset` has after learning `rollouts` one call each,
    alone or beside ranks-1 real rank processes (tasks/training/learner_ranks.py); each call's
    metrics appended to `metrics`."""
    experiment = resolve_experiment(preset, {**changes, "distribution.learners": ranks,
                                             "distribution.learner_device": "cpu"})
    config = experiment.preset
    learner = experiment.algorithm.learner(config.agent, experiment.observation_space, experiment.action_space,
                                           config.seed, "cpu")
    group = LearnerRanks(learner, config, ["cpu"] * ranks, logging.getLogger("ranks")) if ranks > 1 else None
    try:
        for rollout in rollouts:
            said = (group or learner).learn([rollout], 0.0)
            if metrics is not None:
                metrics.append(said)
    finally:
        if group is not None:
            group.close()
    return {key: value.detach().numpy().copy() for key, value in learner.policy_weights().items()}


@LONG
@pytest.mark.parametrize("changes", [{}, {"agent.algo": "impala"}], ids=["appo", "impala"])
def test_two_v_trace_learner_ranks_learn_what_one_learner_learns(changes):
    """APPO's and IMPALA's learners (async runs: their weights are not a run's to compare) on the same
    chunks: two ranks as one learner, within float rounding, and the same weights twice."""
    experiment = resolve_experiment("cartpole-appo", changes)
    distribution, rng = experiment.preset.distribution, np.random.default_rng(0)
    rollouts = [random_rollout(experiment.observation_space, experiment.action_space,
                               experiment.preset.schedule.rollout_steps_per_env, distribution.envs_per_worker, rng)
                for _ in range(4)]
    alone = _learnt_by("cartpole-appo", changes, 1, rollouts)
    two, again = (_learnt_by("cartpole-appo", changes, 2, rollouts) for _ in range(2))
    assert all(np.array_equal(two[key], again[key]) for key in two)
    assert 0 < _largest_difference(alone, two) <= TOLERANCE  # measured 1.2e-7 (appo), 1.5e-7 (impala)
    assert _largest_difference(alone, _learnt_by("cartpole-appo", changes, 1, [])) > 100 * TOLERANCE  # it learnt


@LONG
def test_a_minibatch_with_fewer_rows_than_ranks_leaves_one_rank_none_and_the_ranks_learn_what_one_learner_learns():
    """PPO's last minibatch of an epoch holding one row (rows % minibatch_size == 1): one of two ranks
    is given no rows, its losses means over nothing (NaN, their gradients zeros); the call's metrics are
    the ranks' that had rows, not NaN."""
    experiment = resolve_experiment("cartpole-ppo", {})
    schedule, distribution = experiment.preset.schedule, experiment.preset.distribution
    rows = schedule.rollout_steps_per_env * distribution.envs_per_worker
    rollouts = [random_rollout(experiment.observation_space, experiment.action_space, schedule.rollout_steps_per_env,
                               distribution.envs_per_worker, np.random.default_rng(seed)) for seed in range(2)]
    changes, said = {"agent.minibatch_size": rows - 1}, []
    alone, two = (_learnt_by("cartpole-ppo", changes, ranks, rollouts, said if ranks == 2 else None) for ranks in (1, 2))
    assert all(np.isfinite(value).all() for value in two.values())
    assert 0 < _largest_difference(alone, two) <= TOLERANCE
    assert said and all(np.isfinite(value) for metrics in said for value in metrics.values())  # the other rank's


@LONG
def test_a_rank_lost_while_the_group_takes_rank_0_s_state_is_started_again_and_the_call_made(monkeypatch):
    """A rank SIGKILLed after it started, as rank 0 sends it the learner's state (the group's first
    sync, or one after a restart): the ranks start again and the call is made, as one learner makes it."""
    from gymflow.tasks.training import learner_ranks

    experiment = resolve_experiment("cartpole-ppo", {})
    schedule, distribution = experiment.preset.schedule, experiment.preset.distribution
    rollouts = [random_rollout(experiment.observation_space, experiment.action_space, schedule.rollout_steps_per_env,
                               distribution.envs_per_worker, np.random.default_rng(0))]
    alone = _learnt_by("cartpole-ppo", {}, 1, rollouts)
    made, groups = learner_ranks.LearnerRanks.__init__, []

    def kept(self, *args, **kwargs):
        made(self, *args, **kwargs)
        groups.append(self)

    state_of, kills = learner_ranks.training_state, []

    def killing_first(learner):
        if not kills:  # the child has started (its frame read), the group is made: it dies before its sync
            child = groups[0]._children[0]
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
            kills.append(child.pid)
        return state_of(learner)

    monkeypatch.setattr(learner_ranks.LearnerRanks, "__init__", kept)
    monkeypatch.setattr(learner_ranks, "training_state", killing_first)
    two = _learnt_by("cartpole-ppo", {}, 2, rollouts)
    assert kills and groups[0].restarts == 1
    assert 0 < _largest_difference(alone, two) <= TOLERANCE


def test_a_rank_s_process_gets_none_of_the_flow_s_credentials(monkeypatch):
    """The flow's environment holds storage's and the tracking server's credentials while it runs
    (tasks/tracking/tracker.py); a rank reads no storage and records nothing, so its process has none."""
    secrets = {"AWS_ACCESS_KEY_ID": "gymflow-id", "AWS_SECRET_ACCESS_KEY": "gymflow-secret",
               "AWS_SESSION_TOKEN": "gymflow-session", "MLFLOW_TRACKING_PASSWORD": "gymflow-password",
               "MY_API_TOKEN": "gymflow-token",
               # what a deny-list of names let through (the review's finds): an allow-list gives none of them
               "PREFECT_API_AUTH_STRING": "admin:gymflow-shared-login",
               "PREFECT_API_DATABASE_CONNECTION_URL": "postgresql+asyncpg://postgres:gymflow-db@127.0.0.1/prefect",
               "MLFLOW_BACKEND_STORE_URI": "postgresql://mlflow:gymflow-store@127.0.0.1/mlflow",
               "AZURE_STORAGE_CONNECTION_STRING": "AccountName=a;AccountKey=gymflow-azure"}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    experiment = resolve_experiment("cartpole-ppo", {"distribution.learners": 2})
    config = experiment.preset
    learner = experiment.algorithm.learner(config.agent, experiment.observation_space, experiment.action_space,
                                           config.seed, "cpu")
    group = LearnerRanks(learner, config, ["cpu", "cpu"], logging.getLogger("ranks"))
    try:
        (child,) = [psutil.Process(child.pid) for child in group._children]
        environment = _environment_once_exec_d(child)
    finally:
        group.close()
    assert environment.get("PYTHONPATH") and environment.get("PATH")  # its own environment, read
    assert not set(secrets) & set(environment)
    assert not [name for name, value in environment.items() if value in secrets.values()]


def _environment_once_exec_d(process, within_s: float = 10.0) -> dict[str, str]:
    """A child's environment as its program sees it. Popen returns once exec has passed the point of
    no return (the child's close-on-exec pipe closes), a moment before the kernel sets the new
    program's environment up: read then, /proc/PID/environ is empty."""
    deadline = time.monotonic() + within_s
    while not (environment := process.environ()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return environment


class _SummingGroup:
    """A process group's allreduce for ranks played by threads of this process: every rank's tensor
    summed, the sum given back to each."""

    def __init__(self, world: int):
        self.barrier, self.parts = threading.Barrier(world), {}

    def allreduce(self, tensors):
        (tensor,) = tensors
        self.parts[threading.get_ident()] = tensor.clone()
        self.barrier.wait()
        total = sum(self.parts.values())
        self.barrier.wait()
        tensor.copy_(total)
        return types.SimpleNamespace(wait=lambda: None)


def test_the_ranks_metrics_are_weighted_by_each_rank_s_rows():
    """A minibatch of 10 rows on three ranks (3, 3 and 4 rows): each rank's figure is its own rows'
    mean; the ranks' metrics used to be the plain mean of those, which one learner of all 10 rows never
    reports. Weighted by rows they are the whole batch's; a rank given no rows (NaN) counts for none."""
    values = np.arange(10.0) ** 2
    group, said = _SummingGroup(3), {}

    def rank(index: int, world: int, sizes: list[int]) -> None:
        ranks = Ranks(index, world, group)
        share = ranks.share(len(values))
        rows = values[share.rows]
        mean = float(rows.mean()) if len(rows) else float("nan")
        said[index] = ranks.mean({"loss": mean, "entropy": 1.0}, ranks.rows_in(sizes))

    threads = [threading.Thread(target=rank, args=(index, 3, [10])) for index in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [Ranks(index, 3).share(10).size for index in range(3)] == [3, 3, 4]
    for index in range(3):
        assert said[index]["loss"] == pytest.approx(values.mean()) and said[index]["entropy"] == 1.0, said
    assert values.mean() != pytest.approx(np.mean([values[Ranks(i, 3).share(10).rows].mean() for i in range(3)]))

    values, group, said = np.array([5.0]), _SummingGroup(2), {}  # one row on two ranks: rank 0 has none
    threads = [threading.Thread(target=rank, args=(index, 2, [1])) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert said[0]["loss"] == said[1]["loss"] == 5.0
