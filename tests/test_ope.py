"""Off-policy evaluation (agents/ope.py) on cases whose answer is known: logs of the target itself
(every weight 1: each estimator is the logged mean return), a two-armed bandit and a two-step chain
with known values, and a target the logs do not support."""

from __future__ import annotations

import numpy as np
import pytest

from gymflow.agents.ope import Decisions, Episodes, NoSupport, evaluate_decisions, evaluate_episodes

ARM_VALUES = np.array([0.2, 0.8])  # a two-armed Bernoulli bandit's mean rewards


def _bandit_logs(behaviour: np.ndarray, target: np.ndarray, count: int, seed: int,
                 model_error: float = 0.0) -> Decisions:
    """`count` pulls of the bandit by a policy drawing arms with probabilities `behaviour`; the target's
    probabilities `target`; a reward model off the true values by `model_error`."""
    rng = np.random.default_rng(seed)
    actions = rng.choice(2, size=count, p=behaviour)
    rewards = (rng.random(count) < ARM_VALUES[actions]).astype(np.float64)
    return Decisions(actions, rewards, behaviour[actions], np.tile(target, (count, 1)),
                     np.tile(ARM_VALUES + model_error, (count, 1)), np.tile(behaviour, (count, 1)))


def test_logs_of_the_target_itself_weigh_every_decision_1_and_every_estimator_gives_their_mean_return():
    policy = np.array([0.3, 0.7])
    logs = _bandit_logs(policy, policy, 2_000, seed=1)
    estimates = evaluate_decisions(logs._replace(rewards_model=np.zeros((2_000, 2))))
    mean = logs.rewards.mean()
    for name in ("ips", "snips", "dr"):  # DR with a reward model of zeros is IPS
        assert estimates[name].value == pytest.approx(mean), name
        assert estimates[name].low < mean < estimates[name].high
    assert estimates["ips"].effective_sample_size == pytest.approx(2_000)


@pytest.mark.parametrize("target", [np.array([0.0, 1.0]), np.array([1.0, 0.0]), np.array([0.5, 0.5])])
def test_on_a_two_armed_bandit_each_estimator_finds_the_target_s_value_within_its_interval(target):
    truth = float(target @ ARM_VALUES)
    logs = _bandit_logs(np.array([0.5, 0.5]), target, 4_000, seed=2, model_error=0.1)
    estimates = evaluate_decisions(logs)
    for name, estimate in estimates.items():
        if name == "dm":  # the direct method is its model's: off by the model's error, whatever the logs
            assert estimate.value == pytest.approx(truth + 0.1)
            continue
        assert estimate.low <= truth <= estimate.high, (name, estimate, truth)
        assert abs(estimate.value - truth) < 0.05, (name, estimate)
    assert estimates["dr"].high - estimates["dr"].low < estimates["ips"].high - estimates["ips"].low  # DR: less spread
    assert estimates["ips"].effective_sample_size < 4_000 if target.max() == 1.0 else True


def test_a_target_acting_where_the_behaviour_never_did_is_refused_in_one_line():
    logs = _bandit_logs(np.array([1.0, 0.0]), np.array([0.5, 0.5]), 100, seed=3)
    with pytest.raises(NoSupport) as refused:
        evaluate_decisions(logs)
    assert str(refused.value) == "the target policy acts where the logs have no support: 100 of 100 decisions give " \
                                 "probability 0 to an action it may take"


def _chain_episodes(behaviour_right: float, target_right: float, count: int, seed: int) -> tuple[Episodes, float]:
    """Two decisions an episode; going right pays 1 at each; the target's true discounted value."""
    rng, gamma = np.random.default_rng(seed), 0.9
    right = rng.random((count, 2)) < behaviour_right
    logged = np.where(right, behaviour_right, 1 - behaviour_right)
    target = np.where(right, target_right, 1 - target_right)
    q = np.stack([np.where(right[:, 0], 1 + gamma * target_right, gamma * target_right),
                  right[:, 1].astype(np.float64)], axis=1)  # the target's true Q of the action taken
    v = np.stack([np.full(count, target_right * (1 + gamma)), np.full(count, target_right)], axis=1)
    episodes = Episodes(right.astype(np.float64), logged, target, np.ones((count, 2), bool), q, v)
    return episodes, target_right * (1 + gamma)


@pytest.mark.parametrize("target_right", [0.9, 0.5, 0.1])
def test_over_episodes_each_estimator_finds_the_target_s_value_and_dr_with_a_true_q_has_no_spread(target_right):
    episodes, truth = _chain_episodes(0.5, target_right, 3_000, seed=4)
    estimates = evaluate_episodes(episodes, gamma=0.9)
    for name, estimate in estimates.items():
        assert estimate.low - 1e-9 <= truth <= estimate.high + 1e-9, (name, estimate, truth)
    assert estimates["dr"].value == pytest.approx(truth) and estimates["dr"].high - estimates["dr"].low < 1e-9


def test_on_policy_episodes_give_their_mean_discounted_return_and_padding_counts_nothing():
    episodes, _ = _chain_episodes(0.7, 0.7, 500, seed=5)
    padded = Episodes(*(np.concatenate([part, np.zeros((500, 1), part.dtype)], axis=1) for part in episodes[:4]))
    padded = padded._replace(logged_probs=np.where(padded.mask, padded.logged_probs, 1.0),
                             target_probs=np.where(padded.mask, padded.target_probs, 1.0))
    discounted = float(np.mean(episodes.rewards[:, 0] + 0.9 * episodes.rewards[:, 1]))
    estimates = evaluate_episodes(padded, gamma=0.9)
    assert estimates["pdis"].value == pytest.approx(discounted) and estimates["wpdis"].value == pytest.approx(discounted)
    assert set(estimates) == {"pdis", "wpdis"}  # no Q: no DR
    assert estimates["pdis"].effective_sample_size == pytest.approx(500)


def test_fitted_q_evaluation_learns_the_target_s_q_from_the_logs_alone_and_dr_corrects_with_it():
    """The two-step chain, its states one-hot (the first; the second after right; after left): FQE
    fits the target's Q from the behaviour's transitions; its value of the first state is the truth,
    and DR with that Q finds it within its interval."""
    from gymflow.agents.fqe import FQEOptions, LoggedTransitions, fitted_q, fqe_estimate, q_values

    gamma, behaviour_right, target_right, count = 0.9, 0.5, 0.8, 2_000
    episodes, truth = _chain_episodes(behaviour_right, target_right, count, seed=6)
    right = episodes.rewards.astype(bool)
    states = np.eye(3)
    second = np.where(right[:, 0], 1, 2)
    target = np.tile([1 - target_right, target_right], (count, 1))
    transitions = LoggedTransitions(
        obs=np.concatenate([states[np.zeros(count, int)], states[second]]),
        actions=np.concatenate([right[:, 0], right[:, 1]]).astype(np.int64),
        rewards=np.concatenate([episodes.rewards[:, 0], episodes.rewards[:, 1]]),
        next_obs=np.concatenate([states[second], states[second]]),
        terminal=np.concatenate([np.zeros(count, bool), np.ones(count, bool)]),
        next_target_probs=np.concatenate([target, target]))
    network = fitted_q(transitions, FQEOptions(gamma=gamma, iterations=10, steps_per_iteration=200, seed=0))
    estimate = fqe_estimate(network, states[[0]].repeat(count, axis=0), target)
    assert estimate.value == pytest.approx(truth, abs=0.03)
    q = q_values(network, states)
    np.testing.assert_allclose(q[0], [gamma * target_right, 1 + gamma * target_right], atol=0.05)
    learned_q = np.stack([q[0][right[:, 0].astype(int)], q[second, right[:, 1].astype(int)]], axis=1)
    learned_v = np.stack([np.full(count, q[0] @ [1 - target_right, target_right]),
                          q[second] @ np.array([1 - target_right, target_right])], axis=1)
    dr = evaluate_episodes(episodes._replace(q_values=learned_q, state_values=learned_v), gamma=gamma)["dr"]
    assert dr.low <= truth <= dr.high


def test_weighted_estimators_count_an_episode_that_ended_early_as_zero_reward_after_its_end():
    # on-policy logs of two episodes, 1 and 2 steps, reward 1 a step: their mean discounted return (1 + 1.9) / 2
    episodes = Episodes(rewards=np.array([[1.0, 0.0], [1.0, 1.0]]), logged_probs=np.ones((2, 2)),
                        target_probs=np.ones((2, 2)), mask=np.array([[True, False], [True, True]]),
                        q_values=np.zeros((2, 2)), state_values=np.zeros((2, 2)))
    estimates = evaluate_episodes(episodes, gamma=0.9)
    assert {name: round(estimate.value, 6) for name, estimate in estimates.items()} == {
        "pdis": 1.45, "wpdis": 1.45, "dr": 1.45, "wdr": 1.45}
