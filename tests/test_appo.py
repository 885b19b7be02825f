"""ASYNC on-policy learning: V-trace and the APPO and IMPALA losses held to values computed by
hand on a tiny batch; reward scaling that follows each worker's envs whatever order its chunks
land in; APPO and IMPALA learning Catch under the real Prefect API and Dask worker processes,
with their lag and importance weights recorded (APPO on CartPole: tests/test_solves.py); a worker
killed mid-chunk; bad input refused in one line before any work."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gymnasium import spaces
from mlflow.tracking import MlflowClient

from gymflow.agents import appo, impala
from gymflow.agents.actor_critic import make_actor_critic
from gymflow.agents.configs import APPOConfig, IMPALAConfig
from gymflow.agents.normalization import RewardScaler
from gymflow.agents.vtrace import vtrace_targets
from gymflow.flows.improve import improve
from gymflow.tasks.storage.objects import Storage, StorageLocation
from tests.conftest import local_overrides
from tests.stored import read_ledger
from tests.test_learners import _rollout_of

OBS = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
TWO_ACTIONS = spaces.Discrete(2)


def _column(values: list[float]) -> torch.Tensor:
    return torch.tensor(values).unsqueeze(1)  # [T, 1]: one env


def test_vtrace_truncates_the_weights_and_cuts_the_traces_at_episode_ends():
    # rho = 2, 0.5, 1 (truncated at 1: 1, 0.5, 1); the episode terminates at step 1, step 2 bootstraps from V(s_3)
    targets = vtrace_targets(torch.log(_column([2.0, 0.5, 1.0])), _column([1.0, 1.0, 1.0]), _column([0.5, 0.5, 0.5]),
                             _column([0.5, 0.0, 0.5]), _column([1.0, 0.0, 1.0]), IMPALAConfig(gamma=0.9))
    # deltas: 1 x (1 + 0.45 - 0.5) = 0.95; 0.5 x (1 - 0.5) = 0.25; 0.95. v - V: 0.95 + 0.9 x 1 x 0.25 = 1.175, 0.25, 0.95
    np.testing.assert_allclose(targets.values[:, 0].numpy(), [1.675, 0.75, 1.45], rtol=1e-6)
    # A_t = rho_t (r_t + 0.9 v_t+1 - V_t), with V' where the episode ended: 1 + 0.9 x 0.75 - 0.5; 0.5 x 0.5; 0.95
    np.testing.assert_allclose(targets.advantages[:, 0].numpy(), [1.175, 0.25, 0.95], rtol=1e-6)
    np.testing.assert_allclose(targets.rhos[:, 0].numpy(), [2.0, 0.5, 1.0], rtol=1e-6)


def test_vtrace_is_the_n_step_return_when_the_acting_and_learning_policies_agree():
    rng = np.random.default_rng(0)
    steps, envs, gamma = 5, 3, 0.9
    rewards, values = torch.tensor(rng.normal(size=(steps, envs))), torch.tensor(rng.normal(size=(steps, envs)))
    last = torch.tensor(rng.normal(size=envs))
    next_values = torch.cat([values[1:], last[None]])
    targets = vtrace_targets(torch.zeros(steps, envs, dtype=torch.float64), rewards, values, next_values,
                             torch.ones(steps, envs, dtype=torch.float64), IMPALAConfig(gamma=gamma))
    for t in range(steps):
        n_step = sum(gamma**k * rewards[t + k] for k in range(steps - t)) + gamma ** (steps - t) * last
        np.testing.assert_allclose(targets.values[t].numpy(), n_step.numpy(), rtol=1e-9)
    # and its advantages are GAE's with lambda 1: the n-step return minus the value
    np.testing.assert_allclose(targets.advantages.numpy(), (targets.values - values).numpy(), rtol=1e-9)


def _constant_policy(config: APPOConfig | IMPALAConfig) -> torch.nn.Module:
    """pi = [0.25, 0.75] and V = 1 whatever the observation."""
    network = make_actor_critic(config, OBS, TWO_ACTIONS)
    with torch.no_grad():
        for head, output in ((network.actor, [0.0, math.log(3.0)]), (network.critic, [1.0])):
            for parameter in head.parameters():
                parameter.zero_()
            head[-1].bias.copy_(torch.tensor(output))
    return network


MINIBATCH = {"obs": torch.zeros(2, 2), "actions": torch.tensor([0, 1]), "log_probs": torch.log(torch.tensor([0.9, 0.1])),
             "proximal_log_probs": torch.log(torch.tensor([0.5, 0.5])), "advantages": torch.tensor([1.0, -1.0]),
             "returns": torch.tensor([2.0, 0.0])}  # acted with [0.9, 0.1]; the learner stood at [0.5, 0.5] as it landed
ENTROPY = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))


def test_the_impala_loss_is_the_weighted_policy_gradient_plus_value_error_minus_entropy():
    config = IMPALAConfig(value_coef=0.5, entropy_coef=0.01)
    terms = impala.impala_loss(_constant_policy(config), MINIBATCH, config)
    # -(A log pi(a)): -(1 x log 0.25 + -1 x log 0.75) / 2; the acting policy's probabilities are V-trace's concern
    policy_loss = -(math.log(0.25) - math.log(0.75)) / 2
    assert terms.policy_loss.item() == pytest.approx(policy_loss)
    assert terms.value_loss.item() == pytest.approx(1.0)
    assert terms.entropy.item() == pytest.approx(ENTROPY)
    assert terms.loss.item() == pytest.approx(policy_loss + 0.5 - 0.01 * ENTROPY)


def test_the_appo_loss_clips_the_ratio_to_the_proximal_policy_not_the_acting_one():
    config = APPOConfig(clip_range=0.2, value_coef=0.5, entropy_coef=0.01, normalize_advantages=False)
    loss, metrics = appo.appo_loss(_constant_policy(config), MINIBATCH, config)
    # ratios to the proximal policy 0.25 / 0.5 = 0.5 and 0.75 / 0.5 = 1.5 (to the acting one they would be
    # 0.28 and 7.5): min(0.5 x 1, 0.8 x 1) = 0.5; min(1.5 x -1, 1.2 x -1) = -1.5
    assert metrics["policy_loss"] == pytest.approx(-(0.5 - 1.5) / 2)
    assert metrics["value_loss"] == pytest.approx(1.0)
    assert metrics["clip_fraction"] == pytest.approx(1.0)
    assert loss.item() == pytest.approx(0.5 + 0.5 - 0.01 * ENTROPY)


def test_a_learner_reports_how_far_the_acting_versions_were():
    learner = impala.IMPALALearner(IMPALAConfig(hidden_sizes=[8], vtrace_rho_bar=1.0), OBS, TWO_ACTIONS, seed=0)
    rng = np.random.default_rng(0)
    rollout = _rollout_of(rng, rng.integers(0, 2, (16, 2)))._replace(log_probs=np.full((16, 2), np.log(0.1), np.float32))
    metrics = learner.learn([rollout], 0.0)
    # the learning policy starts near uniform (0.5 each): every weight is ~0.5 / 0.1 = 5, all truncated
    assert metrics["importance_weight_mean"] == pytest.approx(5.0, rel=0.05)
    assert metrics["importance_truncated_share"] == 1.0
    assert learner.train_steps == 1  # one epoch, the whole batch in one step


def test_appo_s_defaults_update_a_batch_more_than_once_so_that_its_clip_acts():
    """The ratio is against the proximal policy: 1 throughout a batch's first update, so one pass
    (IMPALA's default) would never clip; APPO's default passes make the clip act."""
    learner = appo.APPOLearner(APPOConfig(hidden_sizes=[8], lr=0.05), OBS, TWO_ACTIONS, seed=0)
    rng = np.random.default_rng(0)
    metrics = learner.learn([_rollout_of(rng, rng.integers(0, 2, (16, 2)))], 0.0)
    assert learner.train_steps == APPOConfig().epochs > 1 and IMPALAConfig().epochs == 1
    assert metrics["clip_fraction"] > 0


def test_reward_scaling_follows_each_worker_s_envs_whatever_order_their_chunks_land_in():
    rng = np.random.default_rng(0)
    chunks = {worker: [rng.normal(size=(4, 2)) for _ in range(3)] for worker in (0, 1)}
    ended = np.zeros((4, 2), bool)
    in_rounds, interleaved = RewardScaler(0.9), RewardScaler(0.9)
    for chunk in range(3):
        in_rounds.update([chunks[0][chunk], chunks[1][chunk]], [ended, ended])
    # worker 1's chunks land first, then worker 0's, one or two at a time
    interleaved.update([chunks[1][0], chunks[1][1]], [ended, ended], streams=[1, 1])
    interleaved.update([chunks[0][0]], [ended], streams=[0])
    interleaved.update([chunks[0][1], chunks[1][2], chunks[0][2]], [ended, ended, ended], streams=[0, 1, 0])
    np.testing.assert_allclose(interleaved.discounted, in_rounds.discounted)
    assert interleaved.returns.var.item() == pytest.approx(in_rounds.returns.var.item())


# default tier (one of its 25 slowest): APPO's learning test, with inference beside the learner
@pytest.mark.e2e
def test_appo_learns_catch_from_pixels_with_workers_that_never_wait(prefect_api, workspace):
    # the workers' outputs computed beside the learner (on its CPU here, as on a GPU machine's GPU)
    summary = improve("catch-appo", {**local_overrides(workspace), "storage.keep_shards": "all",
                                     "distribution.inference": "learner"})
    assert summary.solved and summary.final_return >= 0.9
    assert summary.env_steps <= 40_000
    assert summary.shards_inserted > 0 and summary.policy_lag_max <= 4
    metrics = MlflowClient(local_overrides(workspace)["tracking.tracking_uri"]).get_run(
        summary.mlflow_run_id).data.metrics
    for name in ("async/policy_lag_mean", "async/policy_lag_max", "train/importance_weight_mean",
                 "train/importance_weight_max", "train/importance_truncated_share", "train/clip_fraction"):
        assert name in metrics, name
    assert metrics["inference/rows"] >= summary.env_steps  # every step acted on the server's outputs
    ledger = read_ledger(Storage(StorageLocation(str(workspace / "data"))), summary.run_id)
    keys = ledger.inserted + ledger.dropped + ledger.unused  # every chunk landed once: learned from, dropped or late
    assert sorted(keys) == Storage(StorageLocation(str(workspace / "data"))).list(
        f"runs/{summary.run_id}/shards/async")
    assert len(set(keys)) == len(keys) and summary.shards_inserted == len(ledger.inserted)


# long tier (18 s here beside another test, 38 s at half the CPU): IMPALA's learning test end to end. The default run
# keeps IMPALA's loss (above) and APPO learning Catch end to end through the same V-trace path (APPO clips its ratio)
@pytest.mark.slow
@pytest.mark.e2e
def test_impala_learns_catch_with_one_pass_over_each_batch(prefect_api, workspace):
    # the paper's one pass a batch: without APPO's clipping, more passes over a lagging batch diverge (4: best 0.2)
    summary = improve("catch-appo", {**local_overrides(workspace), "agent.algo": "impala", "agent.epochs": 1})
    assert summary.solved and summary.final_return >= 0.9 and summary.env_steps <= 60_000
    metrics = MlflowClient(local_overrides(workspace)["tracking.tracking_uri"]).get_run(
        summary.mlflow_run_id).data.metrics
    assert "train/importance_weight_mean" in metrics and "train/clip_fraction" not in metrics


@pytest.mark.parametrize(("preset", "setting", "field"), [
    ("cartpole-appo", "distribution.mode=sync", "distribution.mode"),
    ("cartpole-appo", "distribution.mode=single", "distribution.mode"),
    ("cartpole-appo", "agent.vtrace_rho_bar=0", "agent.vtrace_rho_bar"),
    ("cartpole-appo", "agent.vtrace_c_bar=2.0", "agent.vtrace_c_bar"),
    ("cartpole-appo", "schedule.heatup_env_steps=100", "schedule.heatup_env_steps"),
    ("cartpole-appo", "agent.replay=prioritized", "agent.replay"),
    ("cartpole-ppo", "distribution.mode=async", "distribution.mode"),
])
def test_bad_input_is_refused_in_one_line_before_any_work(preset, setting, field, tmp_path, monkeypatch, capsys):
    from gymflow.flows.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["run", preset, "--set", setting]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"gymflow: error: {field}: ") and "\n" not in error
    assert list(tmp_path.iterdir()) == []  # nothing written


# default tier (one of its 25 slowest): the killed-worker drill for the batch stream (its tending thread replaces it)
@pytest.mark.e2e
def test_an_appo_worker_sigkilled_mid_chunk_is_replaced_from_the_tending_thread_and_no_chunk_counts_twice(
        prefect_api, workspace):
    once = workspace / "killed.once"
    overrides = {**local_overrides(workspace), "env.id": "gymflow.testing.envs:Tripwire",
                 "env.kwargs": {"at_step": 300, "once_file": str(once), "fault": "kill"},
                 "agent.hidden_sizes": [16], "agent.minibatch_size": 32, "agent.epochs": 2,
                 "distribution.envs_per_worker": 2, "schedule.rollout_steps_per_env": 16,
                 "schedule.total_env_steps": 1024, "schedule.evaluate_every_env_steps": 256,
                 "schedule.evaluation_episodes": 4, "schedule.target_return": None, "storage.keep_shards": "all"}
    summary = improve("cartpole-appo", overrides)
    assert int(once.read_text()) in {int(process.split(":")[1]) for process in summary.rollout_processes}
    storage = Storage(StorageLocation(str(workspace / "data")))
    ledger = read_ledger(storage, summary.run_id)
    accounted = ledger.inserted + ledger.dropped + ledger.unused
    assert sorted(accounted) == storage.list(f"runs/{summary.run_id}/shards/async")  # the redone chunk landed once
    for worker in (0, 1):  # and no chunk number is missing
        chunks = sorted(int(key.rsplit("/c", 1)[1][:6]) for key in accounted if f"/w{worker:03d}/" in key)
        assert chunks == list(range(len(chunks)))
    assert summary.env_steps >= 1024


class _SchedulerLost:
    """In-process hosts whose `settle`, once `lost` is set, waits as a HostPool's does while its
    scheduler is away (up to 120 s), until `back` is set: the wait the batch stream's thread makes."""

    def __init__(self) -> None:
        import threading

        from gymflow.tasks.cluster.hosts import InProcessHosts

        self.runs = InProcessHosts()
        self.timeout_s, self.closed, self.one_process = 600.0, False, False
        self.lost, self.waiting, self.back = threading.Event(), threading.Event(), threading.Event()

    def call(self, function, spec, slot, attempt=1):
        return self.runs.call(function, spec, slot, attempt)

    def settle(self, call, logger):
        if self.lost.is_set():
            self.waiting.set()
            self.back.wait(60)
        return call


def test_the_batch_stream_answers_and_a_cancel_returns_while_its_thread_waits_for_the_cluster(tmp_path):
    """The learner's side (what has landed, whether anything is coming) and a Prefect cancellation
    do not wait for the tending thread's cluster waits: it holds the stream's lock only to count."""
    import logging
    import threading
    from functools import partial

    from gymflow.presets.validate import resolve_experiment
    from gymflow.tasks.cluster import jobs
    from gymflow.tasks.cluster.rounds import RoundPlan
    from gymflow.tasks.training.batch_stream import BatchStream
    from gymflow.tasks.training.commits import Commits
    from gymflow.tasks.training.state import LoopState
    from gymflow.tasks.training.stream import Batches

    experiment = resolve_experiment("cartpole-appo", {
        "storage.root": str(tmp_path), "distribution.rollout_workers": 2, "distribution.envs_per_worker": 2,
        "schedule.rollout_steps_per_env": 8, "schedule.total_env_steps": 1024})
    config = experiment.preset
    learner = experiment.algorithm.learner(config.agent, experiment.observation_space, experiment.action_space, 0)
    Commits(Storage(StorageLocation(str(tmp_path))), "run", config.storage, policy_window=4).publish(learner, 0)
    jobs._LIVE_ENVS.clear()
    hosts = _SchedulerLost()
    stream = BatchStream(hosts, RoundPlan(config, "run"), Batches(config.env_steps_per_iteration,
                                                                  config.distribution.max_policy_lag),
                         partial(experiment.algorithm.exploration, config.agent), logging.getLogger("test"))
    state = LoopState.start(2, 10_000)
    first = stream.collect(state)
    assert sum(shard.env_steps for shard in first.landed) >= config.env_steps_per_iteration

    hosts.lost.set()
    assert hosts.waiting.wait(10), "the tending thread never settled a call"
    answered: list[bool] = []
    asking = threading.Thread(target=lambda: answered.append(stream.drained()), daemon=True)
    asking.start()
    asking.join(10)
    cancelling = threading.Thread(target=stream.cancel, daemon=True)
    cancelling.start()
    cancelling.join(10)
    held = asking.is_alive() or cancelling.is_alive()
    hosts.back.set()  # the scheduler back: the tending thread sees the stop and ends
    assert not held, "the stream waited for its thread's wait for the cluster"
    assert answered == [False] and not stream.in_flight
    stream._tender.join(10)
    assert not stream._tender.is_alive()
