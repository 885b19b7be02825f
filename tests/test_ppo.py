"""PPO's learner learns from the very policy that acted: the log-probabilities it computes for a
rollout are the worker's, and with normalisation on, the ratio of its first minibatch is 1."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gymflow.agents import ppo_learner as ppo
from gymflow.agents.algorithms import ALGORITHMS
from gymflow.agents.configs import PPOConfig
from gymflow.agents.ppo import PPOLearner
from gymflow.agents.rollout import collect
from gymflow.envs.vector import SeededVectorEnv

PPO = ALGORITHMS["ppo"]
SETTINGS = dict(normalize_observations=True, normalize_rewards=True, minibatch_size=64, epochs=2, lr=3e-3)


def _worker_policy(learner: PPOLearner, config: PPOConfig, env: SeededVectorEnv, seed: int):
    """What a rollout worker acts with: a fresh network given the published weights."""
    network = PPO.network(config, env.observation_space, env.action_space)
    network.load_state_dict(learner.policy_weights())
    return PPO.policy(network, config, 0.0, seed)


@pytest.mark.parametrize("env_id", ["Pendulum-v1", "CartPole-v1"])
def test_the_learner_scores_a_rollout_as_the_acting_worker_did_and_its_first_ratio_is_one(env_id, monkeypatch):
    config = PPOConfig(**SETTINGS)
    env = SeededVectorEnv(env_id, {}, num_envs=4, seed=3)
    env.reset()
    learner = PPOLearner(config, env.observation_space, env.action_space, seed=0)
    first_minibatch_log_ratios: list[torch.Tensor] = []
    loss = ppo.ppo_loss

    def first_terms_kept(network, minibatch, config, clip_range=None, normalized=False):
        terms = loss(network, minibatch, config, clip_range, normalized)
        if len(first_minibatch_log_ratios) < learned:  # the first minibatch of this `learn`: no step taken yet
            first_minibatch_log_ratios.append(terms.log_ratio.detach().clone())
        return terms

    monkeypatch.setattr(ppo, "ppo_loss", first_terms_kept)
    for learned in range(1, 5):
        rollout, _ = collect(_worker_policy(learner, config, env, seed=learned), env, steps=64)
        with torch.no_grad():
            distribution, _ = learner.network.distribution_and_value(torch.from_numpy(rollout.obs).flatten(0, 1))
            actions = torch.from_numpy(rollout.actions).flatten(0, 1)
            learner_log_probs = distribution.log_prob(actions if env_id == "CartPole-v1" else actions.float())
        np.testing.assert_allclose(learner_log_probs.numpy(), rollout.log_probs.reshape(-1), rtol=1e-5, atol=1e-5)
        mean_before = learner.normalizer.mean.clone()
        learner.learn([rollout], progress=learned / 10)
        assert not torch.equal(learner.normalizer.mean, mean_before)  # the statistics did move, after learning

    assert len(first_minibatch_log_ratios) == 4
    for log_ratio in first_minibatch_log_ratios:
        assert log_ratio.abs().max().item() < 1e-5


def test_orthogonal_initialisation_starts_near_a_zero_mean_action_and_with_gain_sqrt2_hidden_layers():
    from gymnasium import spaces

    config = PPOConfig(hidden_sizes=[64, 64])
    network = ppo.make_network(config, spaces.Box(-1, 1, (11,), np.float32), spaces.Box(-1, 1, (3,), np.float32))
    hidden = network.actor[0].weight.detach()
    # 64 x 11: orthogonal columns scaled by sqrt 2, W^T W = 2 I
    np.testing.assert_allclose((hidden.T @ hidden).numpy(), 2 * np.eye(11), atol=1e-4)
    assert network.actor[-1].weight.abs().max() < 0.05 and network.actor[-1].bias.abs().max() == 0
    value_out = network.critic[-1].weight.detach()
    np.testing.assert_allclose((value_out @ value_out.T).numpy(), [[1.0]], atol=1e-5)


def test_normalised_rewards_are_clipped():
    from gymflow.agents.normalization import RewardScaler

    scaler = RewardScaler(gamma=0.9, clip=5.0)
    scaler.update([np.array([[1.0], [1.0]])], [np.zeros((2, 1), bool)])
    assert scaler.scale(np.array([1e6, -1e6])).tolist() == [5.0, -5.0]
