"""TD3's update against values worked out by hand: the twin-critic minimum, the clipped smoothing
noise, the actor and the targets moving every `policy_delay` critic steps, Polyak targets; and
TD3 learning a small continuous task."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gymnasium import spaces

from gymflow.agents.algorithms import algorithm_of
from gymflow.agents.configs import TD3Config
from gymflow.agents.networks import TransitionBatch, TwinCritic
from gymflow.agents.rollout import RandomPolicy, collect, evaluate
from gymflow.agents.td3 import (
    TD3Learner,
    actor_loss,
    critic_targets,
    make_actor,
    smoothed_target_actions,
)
from gymflow.envs.vector import SeededVectorEnv

OBS = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
ACTIONS = spaces.Box(-2.0, 2.0, shape=(2,), dtype=np.float32)


def _constant_output(layers: torch.nn.Sequential, value: list[float]) -> None:
    """The MLP's last layer outputs `value` whatever its input."""
    with torch.no_grad():
        layers[-1].weight.zero_()
        layers[-1].bias.copy_(torch.tensor(value))


def _constant_critic(critic: TwinCritic, member: int, value: float) -> None:
    """One of the twins' (0: Q1, 1: Q2) last layer outputs `value` whatever its input."""
    with torch.no_grad():
        critic.layers[-1].weight[member].zero_()
        critic.layers[-1].bias[member].fill_(value)


def test_the_smoothing_noise_is_scaled_clipped_and_the_target_action_kept_in_bounds():
    config = TD3Config(hidden_sizes=[4], target_noise=0.2, target_noise_clip=0.5)
    actor = make_actor(config, OBS, ACTIONS)
    _constant_output(actor.net, [np.arctanh(0.9), 0.0])  # the target actor says [0.9, 0.0]
    noise = torch.tensor([[1.0, 1.0], [10.0, -10.0], [-1.0, 2.0]])  # standard-normal draws
    smoothed = smoothed_target_actions(actor, torch.zeros(3, 2), noise, config)
    expected = [[1.0, 0.2],    # 0.9 + 0.2 = 1.1, kept within [-1, 1]; 0 + 0.2
                [1.0, -0.5],   # noise 2.0 and -2.0 clipped to +-0.5
                [0.7, 0.4]]    # 0.9 - 0.2; 0 + 0.4
    np.testing.assert_allclose(smoothed.detach().numpy(), expected, atol=1e-6)


def test_the_critics_target_is_the_reward_plus_the_discounted_smaller_target_q():
    config = TD3Config(hidden_sizes=[4])
    learner = TD3Learner(config, OBS, ACTIONS, seed=0)
    _constant_critic(learner.target_critic, 0, 3.0)
    _constant_critic(learner.target_critic, 1, -1.5)
    batch = TransitionBatch(obs=torch.zeros(2, 2), actions=torch.zeros(2, 2), rewards=torch.tensor([1.0, 2.0]),
                            discounts=torch.tensor([0.99, 0.0]), next_obs=torch.zeros(2, 2), weights=torch.ones(2))
    targets = critic_targets(learner.target_critic, torch.zeros(2, 2), batch)
    np.testing.assert_allclose(targets.numpy(), [1.0 + 0.99 * -1.5, 2.0], atol=1e-6)  # min(3, -1.5); terminal: r


def test_the_actor_follows_the_first_critic_alone():
    config = TD3Config(hidden_sizes=[4])
    learner = TD3Learner(config, OBS, ACTIONS, seed=0)
    _constant_critic(learner.critic, 0, 2.0)
    _constant_critic(learner.critic, 1, -5.0)  # the smaller: not what the actor's gradient follows
    assert actor_loss(learner.actor, learner.critic, torch.zeros(3, 2)).item() == pytest.approx(-2.0)


def _parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    return [parameter.detach().clone() for parameter in module.parameters()]


def test_the_actor_and_the_targets_move_every_policy_delay_critic_steps_by_a_polyak_step():
    config = TD3Config(hidden_sizes=[8], batch_size=4, policy_delay=3, tau=0.25, lr=1e-2)
    env = SeededVectorEnv("gymflow.testing.envs:ContinuousCorridor", {"length": 6, "max_steps": 30}, 2, seed=0)
    env.reset()
    learner = TD3Learner(config, env.observation_space, env.action_space, seed=0)
    rollout, _ = collect(algorithm_of(config).policy(learner.actor, config, 0.0, 0), env, 16)
    learner.replay.add(rollout)
    for step in range(1, 7):
        actor, critic = _parameters(learner.actor), _parameters(learner.critic)
        target_actor, target_critic = _parameters(learner.target_actor), _parameters(learner.target_critic)
        metrics = learner.train(1, progress=0.0)
        assert not all(torch.equal(a, b) for a, b in zip(critic, learner.critic.parameters()))  # every step
        moved = step % 3 == 0
        assert ("actor_loss" in metrics) == moved
        assert all(torch.equal(a, b) for a, b in zip(actor, learner.actor.parameters())) != moved
        for before, target, online in ((target_actor, learner.target_actor, learner.actor),
                                       (target_critic, learner.target_critic, learner.critic)):
            for old, new, live in zip(before, target.parameters(), online.parameters()):
                expected = old + 0.25 * (live.detach() - old) if moved else old
                torch.testing.assert_close(new.detach(), expected)


def test_td3_learns_the_continuous_corridor():
    torch.set_num_threads(1)
    config = TD3Config(lr=3e-3, hidden_sizes=[32, 32], batch_size=64, train_steps_per_iteration=16,
                       exploration_noise=0.1)
    algorithm = algorithm_of(config)
    env = SeededVectorEnv("gymflow.testing.envs:ContinuousCorridor", {"length": 6, "max_steps": 30}, 2, seed=0)
    env.reset()
    learner = algorithm.learner(config, env.observation_space, env.action_space, 0)
    learner.insert([collect(RandomPolicy(env.action_space, 0), env, 64)[0]])  # heatup, as presets have
    for iteration in range(60):
        rollout, _ = collect(algorithm.policy(learner.actor, config, 0.0, iteration), env, 16)
        learner.learn([rollout], progress=iteration / 60)
    evaluation_env = SeededVectorEnv("gymflow.testing.envs:ContinuousCorridor", {"length": 6, "max_steps": 30}, 6, seed=5)
    evaluation_env.reset()
    returns = evaluate(algorithm.policy(learner.actor, config, 0.0, 0), evaluation_env).returns
    assert returns.min() > 0.9
