"""The learner side, held to the papers without an optimiser: each loss function against values
computed by hand on a tiny batch, GAE against its recursion, the log-probability a policy reports
while acting against the one the learner computes for the same action, and every learner's
training state saved and restored whole."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
import typing
from pathlib import Path

import numpy as np
import pytest
import torch
from gymnasium import spaces

from gymflow.agents import appo, bc, dqn, impala, iql, sac, td3
from gymflow.agents import ppo_learner as ppo
from gymflow.agents.actor_critic import PPOPolicy
from gymflow.agents.algorithms import ALGORITHMS
from gymflow.agents.batches import Rollout
from gymflow.agents.configs import (
    APPOConfig,
    BCConfig,
    DQNConfig,
    IMPALAConfig,
    IQLConfig,
    PPOConfig,
    SACConfig,
    TD3Config,
)
from gymflow.agents.core import ReplayLearner
from gymflow.agents.networks import Adam, TransitionBatch, TwinCritic, step_optimizer, twin_td_errors
from gymflow.agents.recurrent import RecurrentPPOLearner
from gymflow.tasks.storage.codec import decode_state, encode_state
from gymflow.testing.rollouts import random_rollout

ROOT = Path(__file__).resolve().parents[1]
OBS = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
TWO_ACTIONS = spaces.Discrete(2)
ONE_DIMENSION = spaces.Box(-2.0, 2.0, shape=(1,), dtype=np.float32)
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def _constant(layers: torch.nn.Sequential, output: list[float]) -> None:
    """An MLP that outputs `output` whatever it reads: zero weights, the output as the last bias."""
    with torch.no_grad():
        for parameter in layers.parameters():
            parameter.zero_()
        layers[-1].bias.copy_(torch.tensor(output))


def _constant_critic(critic: TwinCritic, member: int, output: float) -> None:
    """One of the twins (0: Q1, 1: Q2) outputs `output` whatever it reads: zero weights, the output as
    the last bias."""
    with torch.no_grad():
        for layer in critic.layers:
            layer.weight[member].zero_()
            layer.bias[member].zero_()
        critic.layers[-1].bias[member].fill_(output)


def _batch(rewards: list[float], discounts: list[float], actions: list, weights: list[float] | None = None
           ) -> TransitionBatch:
    size = len(rewards)
    return TransitionBatch(torch.zeros(size, 2), torch.tensor(actions), torch.tensor(rewards), torch.tensor(discounts),
                           torch.zeros(size, 2), torch.tensor(weights or [1.0] * size))


def test_gae_is_the_discounted_sum_of_td_errors_cut_at_episode_ends():
    rewards, values = torch.tensor([[1.0], [1.0], [1.0]]), torch.tensor([[0.5], [0.5], [0.5]])
    next_values = torch.tensor([[0.5], [0.5], [0.0]])  # the episode terminates at step 2
    continues = torch.tensor([[1.0], [1.0], [0.0]])
    advantages = ppo.generalized_advantages(rewards, values, next_values, continues, gamma=0.9, lam=0.8)
    # deltas: 1 + 0.9 * 0.5 - 0.5 = 0.95, 0.95, 1 - 0.5 = 0.5; A_t = delta_t + 0.72 * A_t+1
    np.testing.assert_allclose(advantages[:, 0].numpy(), [0.95 + 0.72 * (0.95 + 0.72 * 0.5), 0.95 + 0.72 * 0.5, 0.5],
                               rtol=1e-6)


def test_the_ppo_loss_is_the_clipped_surrogate_plus_value_error_minus_entropy():
    config = PPOConfig(clip_range=0.2, value_coef=0.5, entropy_coef=0.01, normalize_advantages=False)
    network = ppo.make_network(config, OBS, TWO_ACTIONS)
    _constant(network.actor, [0.0, math.log(3.0)])  # pi = [0.25, 0.75]
    _constant(network.critic, [1.0])
    minibatch = {"obs": torch.zeros(2, 2), "actions": torch.tensor([0, 1]),
                 "log_probs": torch.log(torch.tensor([0.5, 0.5])), "advantages": torch.tensor([1.0, -1.0]),
                 "returns": torch.tensor([2.0, 0.0])}
    terms = ppo.ppo_loss(network, minibatch, config)
    # ratios 0.5 and 1.5: min(0.5 * 1, 0.8 * 1) = 0.5; min(1.5 * -1, 1.2 * -1) = -1.5
    entropy = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert terms.policy_loss.item() == pytest.approx(-(0.5 - 1.5) / 2)
    assert terms.value_loss.item() == pytest.approx(((1 - 2) ** 2 + (1 - 0) ** 2) / 2)
    assert terms.entropy.item() == pytest.approx(entropy)
    assert terms.loss.item() == pytest.approx(0.5 + 0.5 * 1.0 - 0.01 * entropy)
    np.testing.assert_allclose(terms.log_ratio.detach().numpy(), np.log([0.5, 1.5]), rtol=1e-6)


def test_an_annealed_clip_range_shrinks_with_the_run_s_progress_and_is_the_one_the_loss_clips_at():
    config = PPOConfig(clip_range=0.2, normalize_advantages=False)
    network = ppo.make_network(config, OBS, TWO_ACTIONS)
    _constant(network.actor, [0.0, 0.0])  # pi = [0.5, 0.5]: ratio 0.5 against a recorded probability of 1
    minibatch = {"obs": torch.zeros(1, 2), "actions": torch.tensor([0]), "log_probs": torch.tensor([0.0]),
                 "advantages": torch.tensor([-1.0]), "returns": torch.tensor([0.0])}
    # min(0.5 * -1, (1 - eps) * -1): the clipped term decides for a negative advantage
    assert ppo.ppo_loss(network, minibatch, config).policy_loss.item() == pytest.approx(0.8)
    assert ppo.ppo_loss(network, minibatch, config, clip_range=0.05).policy_loss.item() == pytest.approx(0.95)
    annealing = _trained(lambda: ppo.PPOLearner(PPOConfig(minibatch_size=8, anneal_clip_range=True), OBS,
                                                TWO_ACTIONS, 1), steps=4)  # its last iteration at progress 3/4
    assert annealing.clip_range == pytest.approx(0.05)
    assert _trained(lambda: ppo.PPOLearner(PPOConfig(minibatch_size=8), OBS, TWO_ACTIONS, 1)).clip_range == 0.2


@pytest.mark.parametrize("recompute", [False, True])
def test_recomputed_advantages_are_the_critic_s_as_each_epoch_finds_it(recompute):
    """agent.recompute_advantages: each epoch draws its minibatches from GAE with the critic as the
    epochs before left it; without, every epoch draws from the iteration's first."""
    learner = ppo.PPOLearner(PPOConfig(minibatch_size=8, epochs=3, recompute_advantages=recompute,
                                       normalize_advantages=False), OBS, TWO_ACTIONS, 1)
    rng = np.random.default_rng(0)
    rollout = _rollout_of(rng, rng.integers(0, 2, (16, 2)))
    drawn, current = [], []
    passes = learner._passes

    def recorded_passes(batch):
        drawn.append(batch["advantages"].clone())
        current.append(learner._flatten([rollout]))
        return passes(batch)

    learner._passes = recorded_passes
    metrics = learner.learn([rollout], 0.0)
    assert len(drawn) == 3 and not torch.equal(current[0]["advantages"], current[2]["advantages"])  # the critic moved
    for epoch in range(3):
        assert torch.equal(drawn[epoch], current[epoch if recompute else 0]["advantages"])
    # the explained variance is the acting critic's either way: the values the iteration began with
    assert metrics["explained_variance"] == ppo.explained_variance(current[0]["values"], current[0]["returns"])


@pytest.mark.parametrize(("double_q", "expected_targets"), [(False, [1 + 0.5 * 5, 0.0]), (True, [1 + 0.5 * 3, 0.0])])
def test_the_dqn_loss_is_the_weighted_huber_error_against_the_bootstrapped_target(double_q, expected_targets):
    config = DQNConfig(hidden_sizes=[4])
    online, target = dqn.make_network(config, OBS, TWO_ACTIONS), dqn.make_network(config, OBS, TWO_ACTIONS)
    _constant(online, [2.0, 1.0])  # the online network prefers action 0
    _constant(target, [3.0, 5.0])  # the target network values action 1 more
    batch = _batch(rewards=[1.0, 0.0], discounts=[0.5, 0.0], actions=[0, 1], weights=[1.0, 0.5])
    terms = dqn.dqn_loss(online, target, batch, double_q)
    errors = np.array(expected_targets) - [2.0, 1.0]
    huber = np.where(np.abs(errors) < 1, 0.5 * errors**2, np.abs(errors) - 0.5)
    assert terms.loss.item() == pytest.approx(np.mean([1.0, 0.5] * huber))
    np.testing.assert_allclose(terms.td_errors.numpy(), errors, rtol=1e-6)


def _sac_parts():
    config = SACConfig(hidden_sizes=[4])
    actor = sac.make_actor(config, OBS, ONE_DIMENSION)
    with torch.no_grad():  # mean 0, log std 0 everywhere: zero noise gives action 0
        for parameter in actor.parameters():
            parameter.zero_()
    critic = TwinCritic(2, 1, [4], torch.nn.Identity())
    _constant_critic(critic, 0, 1.0)
    _constant_critic(critic, 1, 4.0)
    target = TwinCritic(2, 1, [4], torch.nn.Identity())
    _constant_critic(target, 0, 3.0)
    _constant_critic(target, 1, 2.0)
    return actor, critic, target


def test_the_sac_losses_are_the_soft_bellman_residual_and_the_entropy_regularised_policy_objective():
    actor, critic, target = _sac_parts()
    alpha = torch.tensor(0.5)
    log_prob_at_zero = -LOG_SQRT_2PI - math.log(1 + 1e-6)  # a standard normal at 0, tanh'(0) = 1
    batch = _batch(rewards=[1.0], discounts=[0.9], actions=[[0.0]])
    terms = sac.critic_loss(critic, target, actor, batch, torch.zeros(1, 1), alpha)
    y = 1.0 + 0.9 * (min(3.0, 2.0) - 0.5 * log_prob_at_zero)
    assert terms.loss.item() == pytest.approx(0.5 * ((1.0 - y) ** 2 + (4.0 - y) ** 2), rel=1e-6)
    assert twin_td_errors(terms.errors).item() == pytest.approx(0.5 * (abs(1.0 - y) + abs(4.0 - y)), rel=1e-6)
    loss, log_prob = sac.actor_loss(actor, critic, torch.zeros(1, 2), torch.zeros(1, 1), alpha)
    assert log_prob.item() == pytest.approx(log_prob_at_zero, rel=1e-6)
    assert loss.item() == pytest.approx(0.5 * log_prob_at_zero - min(1.0, 4.0), rel=1e-6)
    temperature = sac.entropy_coef_loss(torch.tensor([math.log(0.5)]), log_prob, target_entropy=-1.0)
    assert temperature.item() == pytest.approx(-math.log(0.5) * (log_prob_at_zero - 1.0), rel=1e-6)


def test_sacs_written_out_temperature_gradient_is_autograds_of_its_loss():
    """The learner steps the temperature on `entropy_coef_gradient`, not on a backward pass of
    `entropy_coef_loss`: the two agree."""
    log_prob = torch.tensor([-1.5, 0.25, 2.0, -0.75])
    log_entropy_coef = torch.tensor([math.log(0.3)], requires_grad=True)
    sac.entropy_coef_loss(log_entropy_coef, log_prob, target_entropy=-2.0).backward()
    torch.testing.assert_close(sac.entropy_coef_gradient(log_prob, target_entropy=-2.0), log_entropy_coef.grad)


def test_the_td3_critic_loss_is_both_critics_squared_error_against_one_target():
    critic = TwinCritic(2, 1, [4], torch.nn.Identity())
    _constant_critic(critic, 0, 1.0)
    _constant_critic(critic, 1, 4.0)
    batch = _batch(rewards=[0.0, 0.0], discounts=[0.0, 0.0], actions=[[0.0], [0.0]], weights=[1.0, 0.5])
    loss, errors, q1 = td3.critic_loss(critic, batch, torch.tensor([2.0, 2.0]))
    assert loss.item() == pytest.approx(np.mean(np.array([1.0, 0.5]) * ((1 - 2) ** 2 + (4 - 2) ** 2)))
    np.testing.assert_allclose(twin_td_errors(errors).numpy(), [1.5, 1.5])
    np.testing.assert_allclose(q1.numpy(), [1.0, 1.0])


@pytest.mark.parametrize("action_space", [TWO_ACTIONS, spaces.Box(-1.0, 1.0, shape=(3,), dtype=np.float32)])
def test_ppo_acts_with_the_log_probabilities_its_learner_computes(action_space):
    config = PPOConfig(log_std_init=-0.5)
    network = ppo.make_network(config, OBS, action_space)
    obs = np.random.default_rng(0).uniform(-1, 1, (64, 2)).astype(np.float32)
    actions, acting = PPOPolicy(network, seed=3).act(obs, explore=True)
    with torch.no_grad():
        distribution, _ = network.distribution_and_value(torch.from_numpy(obs))
        learning = distribution.log_prob(torch.from_numpy(actions)).numpy()
    np.testing.assert_allclose(acting, learning, rtol=1e-5, atol=1e-5)


def test_sac_acts_with_the_log_probability_of_the_action_it_returns():
    config = SACConfig(hidden_sizes=[8])
    torch.manual_seed(0)  # the actor's weights, whatever ran before in this process (an action at the bounds'
    # edge comes back through atanh of its float32 value with an error past the tolerance)
    actor = sac.make_actor(config, OBS, spaces.Box(-2.0, 2.0, shape=(2,), dtype=np.float32))
    obs = np.random.default_rng(0).uniform(-1, 1, (64, 2)).astype(np.float32)
    actions, acting = sac.SACPolicy(actor, seed=3).act(obs, explore=True)
    with torch.no_grad():  # the density of the returned action, from its definition
        mean, log_std = actor(torch.from_numpy(obs))
        squashed = actor.from_env(torch.from_numpy(actions)).double()
        gaussian = torch.distributions.Normal(mean.double(), log_std.double().exp()).log_prob(torch.atanh(squashed))
        learning = (gaussian - torch.log(1 - squashed.pow(2) + 1e-6)).sum(1).numpy()
    np.testing.assert_allclose(acting, learning, rtol=1e-3, atol=1e-3)


def test_td3_acts_with_the_action_its_learner_s_actor_computes():
    """TD3's policy is deterministic, so there is no log-probability to compare: greedily it takes
    the actor's action (the one `actor_loss` scores), scaled to the env's bounds; exploring, that
    action plus the policy's Gaussian noise, clipped to the bounds."""
    box = spaces.Box(-2.0, 2.0, shape=(2,), dtype=np.float32)
    actor = td3.make_actor(TD3Config(hidden_sizes=[8]), OBS, box)
    obs = np.random.default_rng(0).uniform(-1, 1, (64, 2)).astype(np.float32)
    greedy, _ = td3.TD3Policy(actor, noise=0.3, seed=3).act(obs, explore=False)
    exploring, _ = td3.TD3Policy(actor, noise=0.3, seed=3).act(obs, explore=True)
    with torch.no_grad():
        learning = actor(torch.from_numpy(obs)).numpy()
        noisy = np.clip(learning + 0.3 * np.random.default_rng(3).standard_normal(learning.shape), -1.0, 1.0)
        np.testing.assert_allclose(greedy, actor.to_env(torch.from_numpy(learning)).numpy(), rtol=0, atol=1e-6)
        np.testing.assert_allclose(exploring, actor.to_env(torch.from_numpy(noisy.astype(np.float32))).numpy(),
                                   rtol=0, atol=1e-6)
    assert np.abs(exploring - greedy).max() > 0.1 and np.all(np.abs(exploring) <= 2.0)


def _trained(make, steps: int = 2):
    learner = make()
    rng = np.random.default_rng(0)
    continuous = isinstance(learner, sac.SACLearner | td3.TD3Learner | ppo.PPOLearner | iql.IQLLearner
                            | impala.IMPALALearner) and not getattr(
        getattr(learner, "network", None), "discrete", False)
    actions = rng.uniform(-1, 1, (16, 2, 1)).astype(np.float32) if continuous else rng.integers(0, 2, (16, 2))
    rollout = _rollout_of(rng, actions)
    for step in range(steps):
        learner.learn([rollout], step / steps)
    return learner


def _rollout_of(rng: np.random.Generator, actions: np.ndarray) -> Rollout:
    """16 steps of 2 envs of 2-entry observations, acting `actions`, no episode ending."""
    return Rollout(rng.uniform(-1, 1, (16, 2, 2)).astype(np.float32), actions,
                   rng.normal(size=(16, 2)).astype(np.float32), np.zeros((16, 2), bool), np.zeros((16, 2), bool),
                   np.zeros(0, np.int64), np.zeros((0, 2), np.float32), np.zeros((2, 2), np.float32),
                   np.full((16, 2), -0.7, np.float32))


def _fingerprint(value, seen: list | None = None):
    """Everything an object holds that training can change, as comparable plain values. Objects
    that hold others (a learner, a memory, a scaler) are walked once: a shared one is "<shared>"
    the second time (kept in `seen`, so no id is reused while the walk lasts)."""
    seen = [] if seen is None else seen
    if isinstance(value, torch.nn.Module | torch.optim.Optimizer):
        return _fingerprint(value.state_dict(), seen)
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().tobytes()
    if isinstance(value, torch.Generator):
        return value.get_state().numpy().tobytes()
    if isinstance(value, np.random.Generator):
        return repr(value.bit_generator.state)
    if isinstance(value, np.ndarray):
        return value.tobytes()
    if isinstance(value, dict):
        return {str(key): _fingerprint(item, seen) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_fingerprint(item, seen) for item in value]
    if hasattr(value, "__dict__") and not hasattr(value, "model_fields"):  # a plain object; configs do not change
        if any(value is other for other in seen):
            return "<shared>"
        seen.append(value)
        return {name: _fingerprint(item, seen) for name, item in vars(value).items()}
    return value


ACTING_LEARNERS = {  # the learners whose losses read the acting policy's log-probabilities
    "ppo": lambda: ppo.PPOLearner(PPOConfig(minibatch_size=8, epochs=2), OBS, TWO_ACTIONS, 1),
    "recurrent-ppo": lambda: RecurrentPPOLearner(PPOConfig(minibatch_size=16, epochs=2, recurrent=8, hidden_sizes=[8]),
                                                 OBS, TWO_ACTIONS, 1),
    "impala": lambda: impala.IMPALALearner(IMPALAConfig(hidden_sizes=[8], vtrace_lambda=1.0), OBS, TWO_ACTIONS, 1),
    "appo": lambda: appo.APPOLearner(APPOConfig(hidden_sizes=[8], minibatch_size=8), OBS, TWO_ACTIONS, 1),
}


@pytest.mark.parametrize("name", ACTING_LEARNERS)
def test_a_step_the_env_sent_its_own_action_in_is_no_sample_yet_its_reward_reaches_the_steps_before(name):
    """Rows not alive (a C++ backend's FIRE presses, agents/rollout.py): whatever action and
    log-probability they hold, the learning is the same; their rewards still reach the targets of
    the steps before them (the env's own steps, as the Gymnasium path's presses inside a step)."""
    rng = np.random.default_rng(0)
    alive = np.ones((16, 2), bool)
    alive[6:8, 0] = alive[0:2, 1] = False
    rollout = _rollout_of(rng, rng.integers(0, 2, (16, 2)))._replace(alive=alive, memory=np.zeros((2, 2, 8), np.float32))
    garbled = rollout._replace(actions=np.where(alive, rollout.actions, 1 - rollout.actions),
                               log_probs=np.where(alive, rollout.log_probs, -5.0).astype(np.float32))
    rewarded = rollout._replace(rewards=np.where(alive, rollout.rewards, 3.0).astype(np.float32))

    def learnt(batch: Rollout):
        learner = ACTING_LEARNERS[name]()
        learner.learn([batch], 0.0)
        return _fingerprint(learner.network)

    assert learnt(garbled) == learnt(rollout)
    assert learnt(garbled._replace(alive=None)) != learnt(rollout._replace(alive=None))  # as samples they would count
    assert learnt(rewarded) != learnt(rollout)


LEARNERS = {  # every learner, its training state as full as its config makes it (`changes`: to its config)
    "ppo": lambda **changes: ppo.PPOLearner(PPOConfig(minibatch_size=8, epochs=2, **changes), OBS, TWO_ACTIONS, 1),
    "ppo-normalising": lambda **changes: ppo.PPOLearner(
        PPOConfig(minibatch_size=8, normalize_observations=True, normalize_rewards=True, **changes), OBS, ONE_DIMENSION, 1),
    "appo-normalising": lambda **changes: appo.APPOLearner(
        APPOConfig(minibatch_size=8, epochs=2, normalize_observations=True, normalize_rewards=True, **changes), OBS, ONE_DIMENSION, 1),
    "impala": lambda **changes: impala.IMPALALearner(IMPALAConfig(hidden_sizes=[8], **changes), OBS, TWO_ACTIONS, 1),
    "dqn": lambda **changes: dqn.DQNLearner(
        DQNConfig(hidden_sizes=[8], batch_size=4, train_steps_per_iteration=3, replay="prioritized",
                  normalize_observations=True, target_update_every_train_steps=2, **changes), OBS, TWO_ACTIONS, 1),
    "sac": lambda **changes: sac.SACLearner(SACConfig(hidden_sizes=[8], batch_size=4, train_steps_per_iteration=3,
                                            normalize_observations=True, **changes), OBS, ONE_DIMENSION, 1),
    "td3": lambda **changes: td3.TD3Learner(TD3Config(hidden_sizes=[8], batch_size=4, train_steps_per_iteration=3,
                                            normalize_observations=True, **changes), OBS, ONE_DIMENSION, 1),
    "bc": lambda **changes: bc.BCLearner(BCConfig(hidden_sizes=[8], batch_size=4, train_steps_per_iteration=3,
                                        normalize_observations=True, **changes), OBS, TWO_ACTIONS, 1),
    "iql": lambda **changes: iql.IQLLearner(IQLConfig(hidden_sizes=[8], batch_size=4, train_steps_per_iteration=3,
                                            normalize_observations=True, **changes), OBS, ONE_DIMENSION, 1),
}


@pytest.mark.parametrize("make", LEARNERS.values(), ids=LEARNERS)
def test_a_learners_saved_state_holds_everything_training_changes(make):
    trained, fresh = _trained(make), make()
    assert _fingerprint(trained) != _fingerprint(fresh)
    fresh.load_state_dict(decode_state(*encode_state(trained.state_dict())))
    if hasattr(trained, "replay"):  # the memory travels in its own checkpoint blob
        fresh.replay.load_state_dict(trained.replay.state_dict())
    before, after = _fingerprint(trained), _fingerprint(fresh)
    missing = sorted(name for name in before if before[name] != after[name])
    assert missing == [], f"changed by training but not restored from the saved state: {missing}"


@pytest.mark.parametrize("name", LEARNERS)
def test_a_state_copied_from_another_run_trains_with_this_learner_s_own_settings(name):
    """A warm start from a whole learner (and a population member's exploit) loads another run's
    optimiser moments with their param groups: the new preset's learning rate must still apply,
    and SAC's fixed entropy coefficient over the copied one."""
    source = _trained(lambda: LEARNERS[name](lr=1e-3, **({"entropy_coef": None} if name == "sac" else {})))
    copier = LEARNERS[name](lr=3e-5, **({"entropy_coef": 0.05} if name == "sac" else {}))
    copier.load_copied_state(source.state_dict())
    optimizers = [value for value in vars(copier).values() if isinstance(value, torch.optim.Optimizer)]
    assert optimizers and all(group["lr"] == 3e-5 for optimizer in optimizers for group in optimizer.param_groups)
    assert any(optimizer.state for optimizer in optimizers)  # the moments came with the copy
    weights = {key: tensor for key, tensor in copier.policy_weights().items()}
    assert all(torch.equal(weights[key], tensor) for key, tensor in source.policy_weights().items())
    if name == "sac":
        assert copier.log_entropy_coef.exp().item() == pytest.approx(0.05)
        learned = LEARNERS["sac"](entropy_coef=None)
        learned.load_copied_state(source.state_dict())  # a learned coefficient goes on from the copied one
        assert torch.equal(learned.log_entropy_coef, source.log_entropy_coef)


@pytest.mark.parametrize("algorithm", list(ALGORITHMS.values()), ids=list(ALGORITHMS))
def test_the_table_says_on_policy_exactly_where_the_learner_keeps_no_replay_memory(algorithm):
    # presets check `on_policy` without torch; the loop asks the learner for its role: the two must agree
    made = algorithm.parts().learner  # a learner's class, or a function choosing one (PPO's: recurrent or not)
    kind = made if isinstance(made, type) else typing.get_type_hints(made)["return"]
    assert algorithm.on_policy == (not issubclass(kind, ReplayLearner))
    assert algorithm.config().algo == algorithm.name


def test_behaviour_cloning_is_cross_entropy_on_discrete_actions_and_squared_error_on_continuous_ones():
    discrete = bc.make_network(BCConfig(hidden_sizes=[4]), OBS, TWO_ACTIONS)
    _constant(discrete.net, [0.0, math.log(3.0)])  # pi = [0.25, 0.75]
    loss = bc.cloning_loss(discrete, torch.zeros(2, 2), torch.tensor([0, 1]))
    assert loss.item() == pytest.approx(-(math.log(0.25) + math.log(0.75)) / 2)
    continuous = bc.make_network(BCConfig(hidden_sizes=[4]), OBS, ONE_DIMENSION)
    _constant(continuous.net, [math.atanh(0.5)])  # the actor says 0.5 in [-1, 1], 1.0 in the env's [-2, 2]
    loss = bc.cloning_loss(continuous, torch.zeros(2, 2), torch.tensor([[2.0], [-6.0]]))  # 1.0 and -1 (clipped)
    assert loss.item() == pytest.approx(((0.5 - 1.0) ** 2 + (0.5 + 1.0) ** 2) / 2)


def test_iql_fits_an_upper_expectile_of_q_and_its_critics_to_the_value_of_the_next_state():
    assert iql.expectile_loss(torch.tensor([2.0, -2.0]), 0.7).item() == pytest.approx((0.7 * 4 + 0.3 * 4) / 2)
    config = IQLConfig(hidden_sizes=[4], expectile=0.9)
    critic = TwinCritic(2, 1, [4], torch.nn.Identity())
    _constant_critic(critic, 0, 3.0)
    _constant_critic(critic, 1, 1.0)  # min(Q1, Q2) = 1
    value = iql.ValueNetwork(2, [4], torch.nn.Identity())
    _constant(value.net, [2.0])
    batch = _batch([1.0, 0.5], [0.5, 0.0], [[0.1], [0.2]])
    loss, advantages = iql.value_loss(value, critic, batch, config.expectile)
    assert advantages.tolist() == [-1.0, -1.0] and loss.item() == pytest.approx(0.1 * 1.0)
    # targets r + gamma^n V(s'): 1 + 0.5 * 2 = 2 and 0.5 (terminal); Q1 = 3, Q2 = 1
    expected = ((3 - 2) ** 2 + (1 - 2) ** 2 + (3 - 0.5) ** 2 + (1 - 0.5) ** 2) / 2
    assert iql.critic_loss(critic, value, batch).item() == pytest.approx(expected)


def test_iql_extracts_its_policy_by_advantage_weighted_regression_with_clipped_weights():
    config = IQLConfig(hidden_sizes=[4], temperature=2.0, max_weight=5.0)
    actor = iql.make_actor(config, OBS, ONE_DIMENSION)
    _constant(actor.net, [0.0])  # mean 0, std exp(0) = 1
    batch = _batch([0.0, 0.0], [0.0, 0.0], [[0.5], [-1.0]])
    loss = iql.actor_loss(actor, batch, torch.tensor([0.1, 3.0]), config)  # weights e^0.2 and e^6 clipped to 5
    log_probs = [-LOG_SQRT_2PI - 0.5 * 0.25, -LOG_SQRT_2PI - 0.5 * 1.0]
    assert loss.item() == pytest.approx(-(math.exp(0.2) * log_probs[0] + 5.0 * log_probs[1]) / 2)



def test_cql_adds_the_soft_maximum_of_q_minus_the_dataset_action_s_q():
    q_network = dqn.make_network(DQNConfig(hidden_sizes=[4]), OBS, TWO_ACTIONS)
    _constant(q_network, [1.0, 3.0])
    target = dqn.make_network(DQNConfig(hidden_sizes=[4]), OBS, TWO_ACTIONS)
    _constant(target, [0.0, 0.0])
    batch = _batch([0.0, 0.0], [0.0, 0.0], [0, 1])
    plain = dqn.dqn_loss(q_network, target, batch, double_q=False)
    conservative = dqn.dqn_loss(q_network, target, batch, double_q=False, cql_alpha=0.5)
    soft_max = math.log(math.exp(1.0) + math.exp(3.0))
    penalty = ((soft_max - 1.0) + (soft_max - 3.0)) / 2
    assert plain.conservative_penalty is None
    assert conservative.conservative_penalty.item() == pytest.approx(penalty)
    assert conservative.loss.item() == pytest.approx(plain.loss.item() + 0.5 * penalty)


@pytest.mark.parametrize("fused", [True, None])
def test_the_learners_adam_steps_exactly_as_torch_s(fused):
    def trained(optimizer_class) -> list[torch.Tensor]:
        torch.manual_seed(0)
        network = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        optimizer = optimizer_class(network.parameters(), lr=1e-2, eps=1e-5, fused=fused)
        inputs = torch.randn(32, 4)
        for _ in range(5):
            step_optimizer(optimizer, network(inputs).pow(2).mean())
        optimizer.load_state_dict(optimizer.state_dict())
        step_optimizer(optimizer, network(inputs).pow(2).mean())
        return [parameter.detach().clone() for parameter in network.parameters()]

    ours, torch_s = trained(Adam), trained(torch.optim.Adam)
    assert all(torch.equal(a, b) for a, b in zip(ours, torch_s, strict=True))
    assert not torch.equal(ours[0], trained(lambda p, **o: Adam(p, **{**o, "lr": 2e-2}))[0])  # the check can fail


def test_no_learner_imports_torch_dynamo_to_train():
    """torch.compile's machinery (~1.5 s to import) is in no run's start: gymflow compiles nothing."""
    code = ("import sys; from tests.test_learners import LEARNERS, _trained\n"
            "for make in LEARNERS.values(): _trained(make)\n"
            "print(sorted(name for name in sys.modules if name.startswith('torch._dynamo')))")
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert imported.stdout.strip() == "[]"


def test_a_warm_start_names_the_version_of_the_learner_it_copies(tmp_path):
    from gymflow.errors import UnusableWarmStart
    from gymflow.tasks.storage.checkpoints import LEARNER_TENSORS, LEARNER_TREE, commit_checkpoint
    from gymflow.tasks.storage.layout import RunLayout
    from gymflow.tasks.storage.objects import Storage, StorageLocation
    from gymflow.tasks.training.resume import warm_start_learner

    storage, source = Storage(StorageLocation(str(tmp_path))), LEARNERS["dqn"]()
    weights = []
    for version in (3, 4):  # two checkpoints of a run, the learner trained between them
        source = _trained(lambda source=source: source)
        tensors, tree = encode_state(source.state_dict())
        commit_checkpoint(storage, RunLayout("src"), version, {LEARNER_TENSORS: tensors, LEARNER_TREE: tree})
        weights.append({key: tensor.clone() for key, tensor in source.policy_weights().items()})
    for named, expected in (("src@v3", weights[0]), ("src", weights[1]), ("src@v4", weights[1])):
        copier = LEARNERS["dqn"](lr=2e-5)
        warm_start_learner(copier, storage, named)
        assert all(torch.equal(copier.policy_weights()[key], tensor) for key, tensor in expected.items()), named
        assert copier.optimizer.param_groups[0]["lr"] == 2e-5
    for named, says in (("src@v9", "no learner of run 'src'"), ("src@9", "the version after @ is vN")):
        with pytest.raises(UnusableWarmStart, match=says):
            warm_start_learner(LEARNERS["dqn"](), storage, named)


@pytest.mark.parametrize("algo", ["sac", "td3"])
def test_a_training_state_saved_while_the_twin_critics_were_two_networks_trains_on_to_the_same_values(algo):
    """The twin critics became one ensemble (a batched matmul a layer); a run's checkpoint from before
    holds two networks (`q1.*`, `q2.*`) and an optimiser state over their 12 tensors. tests/data holds
    one such state (SAC and TD3, 8x8 critics, after 5 updates) and the critics' values the code before
    the ensemble reached 3 updates later: loaded now, the weights and Adam's moments stacked, the same
    3 updates reach the same values (to float rounding: a batched matmul sums in its own order)."""
    stored = ROOT / "tests" / "data"
    saved = decode_state((stored / f"{algo}-two-critic-networks.safetensors").read_bytes(),
                         (stored / f"{algo}-two-critic-networks.json").read_bytes())
    expected = json.loads((stored / f"{algo}-two-critic-networks-expected.json").read_text())
    assert "q1.0.weight" in saved["critic"] and len(saved["critic_optimizer"]["param_groups"][0]["params"]) == 12
    obs, actions = spaces.Box(-1.0, 1.0, (3,), np.float32), spaces.Box(-2.0, 2.0, (2,), np.float32)
    config = SACConfig(hidden_sizes=[8, 8], batch_size=16) if algo == "sac" else TD3Config(hidden_sizes=[8, 8],
                                                                                           batch_size=16)
    learner = ALGORITHMS[algo].learner(config, obs, actions, 0)
    learner.load_state_dict(saved)
    learner.insert([random_rollout(obs, actions, 64, 2, np.random.default_rng(0))])
    learner.train(3, 0.0)
    with torch.no_grad():
        q1, q2 = learner.critic(torch.tensor(expected["probe_obs"]), torch.tensor(expected["probe_actions"]))
    np.testing.assert_allclose(q1.numpy(), expected["q1_after_3_more"], atol=1e-6)
    np.testing.assert_allclose(q2.numpy(), expected["q2_after_3_more"], atol=1e-6)


def test_adams_kept_lists_step_as_torchs_fused_adam_does_through_a_new_rate_and_a_reloaded_state():
    """gymflow's Adam steps a fused optimiser on lists it keeps (torch's step spends ~250 us of Python a
    call): bit for bit torch's fused Adam, after the learning rate changes and after a state reloads."""
    torch.manual_seed(0)
    ours_net = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    torchs_net = copy.deepcopy(ours_net)
    ours = Adam(ours_net.parameters(), lr=1e-3, fused=True)
    torchs = torch.optim.Adam(torchs_net.parameters(), lr=1e-3, fused=True)
    for step in range(40):
        inputs = torch.randn(32, 5)
        for net, optimizer in ((ours_net, ours), (torchs_net, torchs)):
            optimizer.zero_grad()
            net(inputs).pow(2).mean().backward()
            optimizer.step()
        if step == 10:
            for group in (*ours.param_groups, *torchs.param_groups):
                group["lr"] = 5e-4
        if step == 20:
            ours.load_state_dict(copy.deepcopy(ours.state_dict()))
    assert ours._fused_lists is not None  # the kept lists stepped it
    for mine, theirs in zip(ours_net.parameters(), torchs_net.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    # its step counts, views of one tensor stepped by one addition, are each parameter's own in its state
    assert [float(state["step"]) for state in ours.state_dict()["state"].values()] == [40.0] * 4
    ours.zero_grad()
    assert all(param.grad is None for param in ours_net.parameters())


DENORMALS_ON_EVERY_THREAD = """
import numpy as np, torch
from gymnasium import spaces
from gymflow.agents.algorithms import ALGORITHMS
from gymflow.agents.configs import PPOConfig, SACConfig

torch.set_num_threads(2)
denormals = torch.full((2_000_000,), 1e-39)  # float32's normal floats end at 1.2e-38
print((denormals * 1.0 == 0).float().mean().item())  # the OpenMP pool made: both threads keep them
box = spaces.Box(-1.0, 1.0, (2,), np.float32)
ALGORITHMS["ppo"].learner(PPOConfig(hidden_sizes=[8]), box, box, 0)
print((denormals * 1.0 == 0).float().mean().item())  # PPO's arithmetic as recorded
ALGORITHMS["sac"].learner(SACConfig(hidden_sizes=[8]), box, box, 0)
print((denormals * 1.0 == 0).float().mean().item())
"""


def test_a_twin_critic_learners_process_computes_denormal_floats_as_zero_on_each_of_torchs_threads():
    """Adam's moments of a dead unit's weights decay through the denormal range, where an x86 core
    computes tens of times slower (agents/denormals.py). torch.set_flush_denormal sets the calling
    thread alone: half of a two-thread operation kept them. Made in a process whose OpenMP pool
    already runs, a SAC learner leaves every thread flushing them; a PPO learner changes nothing."""
    ran = subprocess.run([sys.executable, "-c", DENORMALS_ON_EVERY_THREAD], capture_output=True, text=True,
                         timeout=120, check=True)
    assert [float(line) for line in ran.stdout.split()] == [0.0, 0.0, 1.0], ran.stdout
