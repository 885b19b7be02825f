"""Replay memories: a uniform numpy ring buffer, and a proportional prioritized one.

Prioritized replay (Schaul et al. 2016, proportional variant): transition i is sampled with
probability p_i^alpha / sum_j p_j^alpha, where p_i is its last |TD error| plus a small epsilon;
new transitions enter with the largest priority seen so far. Each sample carries an importance
weight (N * P(i))^-beta / max_j (N * P(j))^-beta that corrects the bias, and the learner hands
back new priorities after every batch (`update_priorities`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from gymflow.agents.batches import Rollout, Sample, Steps, Transitions
from gymflow.agents.frames import FRAMES, stacks_to_frames
from gymflow.envs.vector import observation_dtype

if TYPE_CHECKING:
    from gymflow.agents.configs import ReplayOptions


@dataclass(frozen=True)
class MemorySpec:
    """What a memory holds and how it turns a rollout into transitions."""

    capacity: int
    obs_shape: tuple[int, ...]
    obs_dtype: Any
    action_shape: tuple[int, ...]
    action_dtype: Any
    gamma: float
    n_step: int = 1  # transitions bootstrap after this many rewards (DQN's n-step returns)


class ReplayMemory:
    """A ring buffer sampled uniformly. Experience goes in one way: `add(rollout)`."""

    keeps_priorities = False

    def __init__(self, spec: MemorySpec):
        self.spec = spec
        self.capacity = capacity = spec.capacity
        self.arrays = {
            "obs": np.zeros((capacity, *spec.obs_shape), spec.obs_dtype),
            "actions": np.zeros((capacity, *spec.action_shape), spec.action_dtype),
            "rewards": np.zeros(capacity, np.float32),
            "next_obs": np.zeros((capacity, *spec.obs_shape), spec.obs_dtype),
            "discounts": np.zeros(capacity, np.float32),
        }
        self.size = 0
        self.cursor = 0  # where the next transition goes
        self.inserted = 0

    def __len__(self) -> int:
        return self.size

    def add(self, rollout: Rollout) -> np.ndarray:
        """Keep a rollout's n-step transitions; returns their slots."""
        return self._store(n_step_transitions(rollout.steps(), self.spec.gamma, self.spec.n_step))

    def _store(self, batch: Transitions) -> np.ndarray:
        """Store transitions, overwriting the oldest when full; returns their slots."""
        self.inserted += len(batch.rewards)
        if len(batch.rewards) > self.capacity:
            batch = Transitions(*(values[-self.capacity :] for values in batch))
        count = len(batch.rewards)
        index = (self.cursor + np.arange(count)) % self.capacity
        for name, values in batch._asdict().items():
            self.arrays[name][index] = values
        self.cursor = int((self.cursor + count) % self.capacity)
        self.size = min(self.size + count, self.capacity)
        return index

    def sample(self, batch_size: int, rng: np.random.Generator, progress: float = 0.0) -> Sample:
        index = rng.integers(0, self.size, size=batch_size)
        return Sample(self._at(index), index, None)

    def update_priorities(self, index: np.ndarray, td_errors: np.ndarray) -> None:
        """Uniform replay keeps no priorities."""

    def priorities(self) -> dict[str, np.ndarray]:
        """What training changes in the memory (copies): nothing, for uniform replay."""
        return {}

    def load_priorities(self, saved: dict[str, np.ndarray]) -> None:
        """Put back what `priorities` gave."""

    def _at(self, index: np.ndarray) -> Transitions:
        return Transitions(**{name: values[index] for name, values in self.arrays.items()})

    def state_dict(self) -> dict[str, np.ndarray]:
        state = {name: values[: self.size] for name, values in self.arrays.items()}
        state["counters"] = np.array([self.size, self.cursor, self.inserted], dtype=np.int64)
        return state

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        self.size, self.cursor, self.inserted = (int(x) for x in state["counters"][:3])
        for name in self.arrays:
            self.arrays[name][: self.size] = state[name]

    def position(self) -> dict[str, int]:
        """Where the memory stands: with the transitions inserted last, it is the whole memory."""
        return {"size": self.size, "cursor": self.cursor, "inserted": self.inserted}

    def bytes_per_transition(self) -> float:
        """What the memory holds, in bytes, over its capacity in transitions."""
        return sum(values.nbytes for values in self.arrays.values()) / self.capacity

    def start_before(self, position: dict[str, int], rollouts: Sequence[Rollout]) -> None:
        """Rebuilding from the newest rollouts only: stand where the memory stood before they
        went in, given where it stands after them (`position`)."""
        self.start_at(position["inserted"] - sum(rollout.env_steps for rollout in rollouts))

    def start_at(self, inserted: int) -> None:
        """Rebuilding from the newest transitions only: continue as if `inserted` transitions had
        gone in before, so each of the next ones lands in the slot it first did. Once they cover
        the capacity, the memory is the one that held them."""
        self.inserted, self.cursor, self.size = inserted, inserted % self.capacity, min(inserted, self.capacity)


class SumTree:
    """Priorities in the leaves of a complete binary tree whose nodes hold their children's sum:
    O(log n) updates and prefix-sum searches, vectorised over a batch with numpy."""

    def __init__(self, capacity: int):
        self.leaves = 1 << max(int(np.ceil(np.log2(max(capacity, 1)))), 0)
        self.nodes = np.zeros(2 * self.leaves, np.float64)  # node 1 is the root; leaf i is node leaves + i

    @property
    def total(self) -> float:
        return float(self.nodes[1])

    def get(self, index: np.ndarray) -> np.ndarray:
        return self.nodes[self.leaves + np.asarray(index)]

    def set(self, index: np.ndarray, values: np.ndarray) -> None:
        nodes = self.leaves + np.asarray(index, dtype=np.int64)
        self.nodes[nodes] = values
        parents = np.unique(nodes // 2)
        while parents[0] >= 1:
            self.nodes[parents] = self.nodes[2 * parents] + self.nodes[2 * parents + 1]
            if parents[0] == 1:
                break
            parents = np.unique(parents // 2)

    def find(self, prefix_sums: np.ndarray) -> np.ndarray:
        """For each value u in [0, total), the leaf i with sum(leaves[:i]) <= u < sum(leaves[:i + 1])."""
        node = np.ones(len(prefix_sums), dtype=np.int64)
        remaining = np.asarray(prefix_sums, dtype=np.float64).copy()
        while node[0] < self.leaves:
            left = 2 * node
            go_right = remaining >= self.nodes[left]
            remaining -= np.where(go_right, self.nodes[left], 0.0)
            node = left + go_right
        return node - self.leaves


class PrioritizedReplayMemory(ReplayMemory):
    """Proportional prioritized replay with importance weights; see the module's docstring."""

    keeps_priorities = True

    def __init__(self, spec: MemorySpec, options: ReplayOptions):
        super().__init__(spec)
        self.options = options
        self.tree = SumTree(spec.capacity)
        self.max_priority = 1.0

    def _store(self, batch: Transitions) -> np.ndarray:
        index = super()._store(batch)
        self.tree.set(index, np.full(len(index), self.max_priority**self.options.priority_alpha))
        return index

    def sample(self, batch_size: int, rng: np.random.Generator, progress: float = 0.0) -> Sample:
        total = self.tree.total
        # one draw in each of batch_size equal slices of the total (stratified, as in the paper)
        bounds = np.linspace(0.0, total, batch_size + 1)
        draws = rng.uniform(bounds[:-1], bounds[1:])
        index = np.minimum(self.tree.find(np.minimum(draws, np.nextafter(total, 0))), self.size - 1)
        probabilities = self.tree.get(index) / total
        beta = self.beta(progress)
        weights = (self.size * probabilities) ** -beta
        smallest = self.tree.get(np.arange(self.size)).min() / total  # the largest weight
        weights = weights / (self.size * smallest) ** -beta
        return Sample(self._at(index), index, weights.astype(np.float32))

    def beta(self, progress: float) -> float:
        start = self.options.priority_beta_start
        return start + min(max(progress, 0.0), 1.0) * (1.0 - start)

    def priorities(self) -> dict[str, np.ndarray]:
        return {"nodes": self.tree.nodes.copy(), "max_priority": np.array([self.max_priority])}

    def load_priorities(self, saved: dict[str, np.ndarray]) -> None:
        self.tree.nodes[:] = saved["nodes"]
        self.max_priority = float(saved["max_priority"][0])

    def update_priorities(self, index: np.ndarray, td_errors: np.ndarray) -> None:
        priorities = np.abs(np.asarray(td_errors, np.float64)) + self.options.priority_epsilon
        self.max_priority = max(self.max_priority, float(priorities.max()))
        self.tree.set(index, priorities**self.options.priority_alpha)

    def state_dict(self) -> dict[str, np.ndarray]:
        state = super().state_dict()
        state["priorities"] = self.tree.get(np.arange(self.size))
        state["max_priority"] = np.array([self.max_priority])
        return state

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        super().load_state_dict(state)
        self.tree = SumTree(self.capacity)
        if self.size:
            self.tree.set(np.arange(self.size), state["priorities"])
        self.max_priority = float(state["max_priority"][0])


def memory_spec(config: Any, observation_space: Any, action_space: Any, n_step: int = 1) -> MemorySpec:
    """The spec of an off-policy agent's memory (`config.replay_capacity`, `config.gamma`): images
    kept as their uint8, other observations as float32; discrete actions as int64."""
    discrete = not action_space.shape
    return MemorySpec(config.replay_capacity, tuple(observation_space.shape), observation_dtype(observation_space),
                      tuple(action_space.shape), np.int64 if discrete else np.float32, config.gamma, n_step)


def make_replay(spec: MemorySpec, options: ReplayOptions) -> ReplayMemory:
    """The memory for a spec: stacked uint8 frames kept once, else uniform or prioritized."""
    if len(spec.obs_shape) == 3 and np.dtype(spec.obs_dtype) == np.uint8:
        if options.replay != "uniform":  # presets/validate.py refuses it first, as agent.replay
            raise ValueError(f"agent.replay: {options.replay!r} is not built for image observations; use 'uniform'")
        return FrameReplayMemory(spec)
    if options.replay == "prioritized":
        return PrioritizedReplayMemory(spec, options)
    return ReplayMemory(spec)


def n_step_transitions(batch: Steps, gamma: float, n: int) -> Transitions:
    """Flat n-step transitions from [T, N] arrays of consecutive steps.

    From step t: the discounted sum of up to n rewards, stopping at the first step that ends the
    episode, and the observation to bootstrap from with discount gamma^k (0 where the episode
    terminated; a truncated episode bootstraps from its final observation). The last steps of a
    batch use as many steps as the batch holds, so nothing is held back between batches."""
    obs, actions, rewards, next_obs, terminated, truncated = batch
    steps, envs = rewards.shape
    total = np.zeros((steps, envs), np.float64)
    discount = np.ones((steps, envs), np.float64)
    open_ = np.ones((steps, envs), bool)  # still accumulating
    last = np.tile(np.arange(steps)[:, None], (1, envs))  # the step whose next_obs we bootstrap from
    ended_terminal = np.zeros((steps, envs), bool)
    ends = terminated | truncated
    for k in range(n):
        later = np.arange(steps) + k
        inside = later < steps
        active = open_ & inside[:, None]
        at = np.minimum(later, steps - 1)
        total += np.where(active, discount * rewards[at], 0.0)
        discount = np.where(active, discount * gamma, discount)
        last = np.where(active, at[:, None], last)
        ended_terminal |= active & terminated[at]
        open_ = active & ~ends[at]
    columns = np.arange(envs)[None, :]
    return Transitions(
        obs=obs.reshape(-1, *obs.shape[2:]),
        actions=actions.reshape(-1, *actions.shape[2:]),
        rewards=total.astype(np.float32).reshape(-1),
        next_obs=next_obs[last, columns].reshape(-1, *obs.shape[2:]),
        discounts=np.where(ended_terminal, 0.0, discount).astype(np.float32).reshape(-1),
    )


FRAME_SLACK = 1 / 16  # frames the memory holds beyond one per transition: episode and rollout starts add some


class FrameReplayMemory(ReplayMemory):
    """A uniform replay memory of stacked uint8 frames [k, height, width] that keeps each frame
    once (as DQN Zoo's and SB3's memory-optimised buffers do), and stacks them as it samples.

    Frames live in a ring of `capacity * (1 + FRAME_SLACK)` frames, each known by its serial (how
    many frames went in before it); a transition holds the serials of its observation's and its
    next observation's k frames (agents/frames.py finds a rollout's distinct frames). At 84x84x4
    that is ~7.4 KB a transition instead of 56 KB. A transition whose oldest frame the ring has
    overwritten (only where episodes or rollouts are shorter than ~16 steps) is not sampled: a
    draw that lands on one is drawn again.
    """

    def __init__(self, spec: MemorySpec):
        depth, *frame_shape = spec.obs_shape
        super().__init__(replace(spec, obs_shape=(depth,), obs_dtype=np.int64))  # a stack as its frames' serials
        self.frames = np.zeros((spec.capacity + int(np.ceil(spec.capacity * FRAME_SLACK)), *frame_shape), np.uint8)
        self.oldest_frame = np.zeros(spec.capacity, np.int64)  # the smallest serial each transition reads
        self.frames_written = 0

    def add(self, rollout: Rollout) -> np.ndarray:
        encoded = stacks_to_frames(rollout)
        by_index = rollout._replace(obs=encoded["obs"], done_obs=encoded["done_obs"], last_obs=encoded["last_obs"])
        transitions = n_step_transitions(by_index.steps(), self.spec.gamma, self.spec.n_step)  # as frame indices
        serial = self.frames_written
        frames = encoded[FRAMES][-len(self.frames):]
        skipped = len(encoded[FRAMES]) - len(frames)
        self.frames[(serial + skipped + np.arange(len(frames))) % len(self.frames)] = frames
        self.frames_written += len(encoded[FRAMES])
        index = self._store(transitions._replace(obs=transitions.obs + serial, next_obs=transitions.next_obs + serial))
        self.oldest_frame[index] = np.minimum(transitions.obs.min(axis=1), transitions.next_obs.min(axis=1))[
            -len(index):] + serial
        return index

    def sample(self, batch_size: int, rng: np.random.Generator, progress: float = 0.0) -> Sample:
        index = rng.integers(0, self.size, size=batch_size)
        while (stale := self.oldest_frame[index] < self.frames_written - len(self.frames)).any():
            index[stale] = rng.integers(0, self.size, size=int(stale.sum()))
        return Sample(self._at(index), index, None)

    def _at(self, index: np.ndarray) -> Transitions:
        serials = super()._at(index)
        ring = len(self.frames)
        return serials._replace(obs=self.frames[serials.obs % ring], next_obs=self.frames[serials.next_obs % ring])

    def bytes_per_transition(self) -> float:
        return super().bytes_per_transition() + (self.frames.nbytes + self.oldest_frame.nbytes) / self.capacity

    def start_before(self, position: dict[str, int], rollouts: Sequence[Rollout]) -> None:
        super().start_before(position, rollouts)
        self.frames_written = position["frames_written"] - sum(len(stacks_to_frames(r)[FRAMES]) for r in rollouts)

    def position(self) -> dict[str, int]:
        return super().position() | {"frames_written": self.frames_written}

    def state_dict(self) -> dict[str, np.ndarray]:
        state = super().state_dict()
        state["oldest_frame"] = self.oldest_frame[: self.size]
        state["frames"] = self.frames
        state["counters"] = np.append(state["counters"], self.frames_written)
        return state

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        super().load_state_dict(state)
        self.frames_written = int(state["counters"][3])
        self.oldest_frame[: self.size] = state["oldest_frame"]
        self.frames[:] = state["frames"]
