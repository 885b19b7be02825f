"""Replay memories: prioritized sampling follows the priorities, the learner's updates change
them, importance weights correct for them; n-step returns stop where episodes end."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium import spaces

from gymflow.agents.batches import Rollout, Steps
from gymflow.agents.configs import DQNConfig, ReplayOptions, SACConfig, TD3Config
from gymflow.agents.dqn import DQNLearner
from gymflow.agents.replay import MemorySpec, PrioritizedReplayMemory, SumTree, n_step_transitions
from gymflow.agents.sac import SACLearner
from gymflow.agents.td3 import TD3Learner


def one_env_rollout(obs: np.ndarray, rewards: np.ndarray, terminated: bool = False,
                    actions: np.ndarray | None = None) -> Rollout:
    """T steps of one env: observations [T, *obs_shape], rewards [T], actions [T, ...] (discrete 0 by
    default); every step terminal or none."""
    steps = len(rewards)
    ends = np.full((steps, 1), terminated)
    actions = np.zeros(steps, np.int64) if actions is None else actions
    return Rollout(obs[:, None], actions[:, None], rewards[:, None].astype(np.float32), ends,
                   np.zeros((steps, 1), bool), np.flatnonzero(ends).astype(np.int64), obs[ends[:, 0]], obs[-1:],
                   np.zeros((steps, 1), np.float32))


def _memory(size: int, alpha: float = 1.0, beta: float = 0.4) -> PrioritizedReplayMemory:
    spec = MemorySpec(size, (1,), np.float32, (), np.int64, gamma=1.0)
    memory = PrioritizedReplayMemory(spec, ReplayOptions(
        replay="prioritized", priority_alpha=alpha, priority_beta_start=beta, priority_epsilon=1e-9))
    values = np.arange(size, dtype=np.float32)
    memory.add(one_env_rollout(values[:, None], values))
    return memory


def _probabilities(memory: PrioritizedReplayMemory) -> np.ndarray:
    """The sampling probability of every stored transition."""
    return memory.tree.get(np.arange(memory.size)) / memory.tree.total


def _frequencies(memory: PrioritizedReplayMemory, draws: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    counts = np.zeros(len(memory))
    for _ in range(draws // 500):
        np.add.at(counts, memory.sample(500, rng).index, 1)
    return counts / counts.sum()


def test_sum_tree_finds_the_leaf_holding_each_prefix_sum():
    tree = SumTree(5)
    tree.set(np.arange(5), np.array([1.0, 0.0, 2.0, 3.0, 4.0]))
    assert tree.total == 10.0
    np.testing.assert_array_equal(tree.find(np.array([0.0, 0.99, 1.0, 2.99, 3.0, 5.99, 6.0, 9.99])), [0, 0, 2, 2, 3, 3, 4, 4])


def test_new_transitions_are_sampled_uniformly_at_the_largest_priority():
    memory = _memory(8)
    np.testing.assert_allclose(_probabilities(memory), np.full(8, 1 / 8))
    np.testing.assert_allclose(_frequencies(memory, 40_000), np.full(8, 1 / 8), atol=0.01)


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_sampling_follows_the_priorities_and_updates_change_them(alpha):
    memory = _memory(4, alpha=alpha)
    memory.update_priorities(np.arange(4), np.array([1.0, 2.0, 3.0, 4.0]))
    expected = np.array([1.0, 2.0, 3.0, 4.0]) ** alpha
    np.testing.assert_allclose(_frequencies(memory, 100_000), expected / expected.sum(), atol=0.01)
    memory.update_priorities(np.array([0, 3]), np.array([-8.0, 0.5]))  # |TD error|: the sign does not matter
    expected = np.array([8.0, 2.0, 3.0, 0.5]) ** alpha
    np.testing.assert_allclose(_frequencies(memory, 100_000, seed=1), expected / expected.sum(), atol=0.01)
    assert memory.max_priority == pytest.approx(8.0)


def test_importance_weights_undo_the_priorities_and_anneal_to_full_correction():
    memory = _memory(4)
    memory.update_priorities(np.arange(4), np.array([1.0, 2.0, 3.0, 4.0]))
    rng = np.random.default_rng(0)
    for progress, beta in ((0.0, 0.4), (1.0, 1.0)):
        sample = memory.sample(256, rng, progress)
        probabilities = np.array([1.0, 2.0, 3.0, 4.0])[sample.index] / 10
        expected = (4 * probabilities) ** -beta / (4 * 0.1) ** -beta  # normalised by the largest weight
        np.testing.assert_allclose(sample.weights, expected, rtol=1e-5)
    assert sample.weights.max() <= 1.0


LEARNERS_WITH_PRIORITIES = {
    "dqn": (lambda obs, actions: DQNLearner(DQNConfig(hidden_sizes=[8], batch_size=16, replay="prioritized"), obs, actions, 0), spaces.Discrete(2)),
    "sac": (lambda obs, actions: SACLearner(SACConfig(hidden_sizes=[8], batch_size=16, replay="prioritized"), obs, actions, 0), spaces.Box(-1, 1, (1,), np.float32)),
    "td3": (lambda obs, actions: TD3Learner(TD3Config(hidden_sizes=[8], batch_size=16, replay="prioritized"), obs, actions, 0), spaces.Box(-1, 1, (1,), np.float32)),
}


@pytest.mark.parametrize("algorithm", sorted(LEARNERS_WITH_PRIORITIES))
def test_the_learner_hands_back_new_priorities_after_each_batch(algorithm):
    make, action_space = LEARNERS_WITH_PRIORITIES[algorithm]
    observation_space = spaces.Box(-1, 1, (2,), np.float32)
    learner = make(observation_space, action_space)
    count = 64
    rng = np.random.default_rng(0)
    actions = None if algorithm == "dqn" else rng.uniform(-1, 1, (count, 1)).astype(np.float32)
    learner.replay.add(one_env_rollout(rng.random((count, 2), np.float32), rng.normal(size=count) * 10,
                                       terminated=True, actions=actions))
    before = _probabilities(learner.replay).copy()
    np.testing.assert_allclose(before, 1 / count)
    learner.train(4, progress=0.0)
    after = _probabilities(learner.replay)
    assert not np.allclose(after, before)
    # transitions with large rewards have large TD errors now, and are drawn more often
    rewards = learner.replay.arrays["rewards"][:count]
    assert np.corrcoef(np.abs(rewards)[after != before[0]], after[after != before[0]])[0, 1] > 0.5


def test_prioritized_memory_round_trips_with_its_priorities():
    memory = _memory(6)
    memory.update_priorities(np.arange(6), np.arange(1.0, 7.0))
    copy = PrioritizedReplayMemory(memory.spec, memory.options)
    copy.load_state_dict(memory.state_dict())
    np.testing.assert_allclose(_probabilities(copy), _probabilities(memory))
    assert copy.max_priority == memory.max_priority


def test_n_step_returns_stop_at_episode_ends_and_at_the_batch_edge():
    # one env, 5 steps: the episode terminates at step 1, a new one is truncated at step 3
    rewards = np.array([[1.0], [2.0], [3.0], [4.0], [5.0]], np.float32)
    terminated = np.array([[False], [True], [False], [False], [False]])
    truncated = np.array([[False], [False], [False], [True], [False]])
    obs = np.arange(5, dtype=np.float32).reshape(5, 1, 1)
    next_obs = obs + 10
    batch = n_step_transitions(Steps(obs, np.zeros((5, 1), np.int64), rewards, next_obs, terminated, truncated), 0.5, 3)
    np.testing.assert_allclose(batch.rewards, [1 + 0.5 * 2, 2, 3 + 0.5 * 4, 4, 5])
    np.testing.assert_allclose(batch.discounts, [0.0, 0.0, 0.25, 0.5, 0.5])
    np.testing.assert_allclose(batch.next_obs[:, 0], [11, 11, 13, 13, 14])
