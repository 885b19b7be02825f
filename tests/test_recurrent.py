"""Recurrent PPO (agent.recurrent): a memory carried along each env's episode, replayed exactly by
the learner; the logged model passes it in and out. Partially observed envs (env.hide) are what it
is for: tests/test_solves.py holds cartpole-po-ppo to CartPole's target, the velocities hidden."""

from __future__ import annotations

import mlflow
import numpy as np
import pytest
import torch

from gymflow.agents.recurrent import episode_starts
from gymflow.agents.rollout import collect
from gymflow.envs.vector import SeededVectorEnv
from gymflow.presets.validate import resolve_experiment
from tests.conftest import local_overrides

PARTIAL = {"env.hide": [1, 3], "agent.recurrent": 8, "agent.hidden_sizes": [16]}


def _learner_and_policy(overrides: dict):
    torch.set_num_threads(1)  # as a run's learner and workers are
    experiment = resolve_experiment("cartpole-ppo", {**PARTIAL, **overrides})
    learner = experiment.algorithm.learner(experiment.preset.agent, experiment.observation_space,
                                           experiment.action_space, 0)
    policy = experiment.algorithm.policy(learner.network, experiment.preset.agent, 1.0, 3)
    env = SeededVectorEnv("CartPole-v1", {}, 4, 0, experiment.preset.env.preprocessing())
    env.reset()
    return learner, policy, env


@pytest.mark.parametrize("normalize", [False, True])
def test_the_learner_replays_each_env_s_sequence_to_the_log_probabilities_that_acted(normalize):
    """Two rounds (the memory carried from one to the next), episodes ending inside them (the
    memory emptied there): the learner's sequence pass gives the acting log-probabilities back."""
    learner, policy, env = _learner_and_policy({"agent.normalize_observations": normalize})
    first, _ = collect(policy, env, 60)
    second, _ = collect(policy, env, 60)
    assert not first.memory.any() and second.memory.any() and len(first.done_index) + len(second.done_index) > 2
    with torch.no_grad():
        for rollout in (first, second):
            features, _ = learner.network.sequence(torch.from_numpy(rollout.obs),
                                                   torch.from_numpy(episode_starts(rollout)),
                                                   torch.from_numpy(rollout.memory))
            acted = learner.network.distribution(features).log_prob(torch.from_numpy(rollout.actions))
            np.testing.assert_allclose(acted.numpy(), rollout.log_probs, atol=1e-5)
    metrics = learner.learn([first, second], progress=0.0)
    assert metrics["train_steps"] > 0 and np.isfinite(metrics["value_loss"])


def test_an_episode_s_end_empties_that_env_s_memory_alone():
    _, policy, env = _learner_and_policy({})
    collect(policy, env, 5)
    before = policy.memory.copy()
    policy.episodes_ended([2])
    assert not policy.memory[:, 2].any() and np.array_equal(np.delete(policy.memory, 2, axis=1),
                                                           np.delete(before, 2, axis=1))


@pytest.mark.e2e
def test_a_recurrent_run_logs_a_model_that_takes_and_gives_back_its_memory(prefect_api, workspace, tiny_budget):
    from gymflow.flows.improve import improve
    from gymflow.tasks.tracking.models import ModelRef, register_challenger, score_policy

    run = improve("cartpole-ppo", {**tiny_budget, "agent.recurrent": 8, "agent.hidden_sizes": [16],
                                   **local_overrides(workspace)})
    tracking_uri = local_overrides(workspace)["tracking.tracking_uri"]
    mlflow.set_tracking_uri(tracking_uri)
    model = mlflow.pyfunc.load_model(run.model_uri)
    observations = np.zeros((3, 2), np.float32)
    out = model.predict({"observations": observations, "memory": np.zeros((2, 3, 8), np.float32)})
    assert out["actions"].shape == (3,) and out["memory"].shape == (2, 3, 8) and out["memory"].any()
    again = model.predict({"observations": observations, "memory": np.zeros((2, 3, 8), np.float32)})
    np.testing.assert_array_equal(again["memory"], out["memory"])  # no state kept between calls
    registered: ModelRef = register_challenger(tracking_uri, "recurrent", run.mlflow_run_id, run.model_uri)
    from gymflow.presets.model import EnvConfig

    returns = score_policy(tracking_uri, registered, EnvConfig(id="gymflow.testing.envs:Corridor"), 4, 0)
    assert len(returns) == 4
