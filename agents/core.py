"""What algorithms, collection and the rest of gymflow agree on: batches and roles.

Nothing here knows about Prefect, Dask, storage or MLflow.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from gymflow.agents.normalization import ObservationNormalizer, observe
from gymflow.agents.replay import ReplayMemory, Steps


def on_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A numpy array as a tensor on the learner's device (a view of it on the CPU)."""
    return torch.from_numpy(array).to(device)


def cpu_weights(network: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A network's weights on the CPU, where rollout workers, checkpoints and MLflow read them
    (the live tensors themselves when the learner is on the CPU)."""
    return {name: tensor.cpu() for name, tensor in network.state_dict().items()}


class Rollout(NamedTuple):
    """T steps of N envs, as one rollout worker collected them."""

    obs: np.ndarray  # [T, N, *obs_shape]
    actions: np.ndarray  # [T, N, *action_shape]
    rewards: np.ndarray  # [T, N] float32
    terminated: np.ndarray  # [T, N] bool: a terminal state (an episode's end, or an Atari life lost in training)
    truncated: np.ndarray  # [T, N] bool: the episode was cut (time limit); bootstrap from it
    done_index: np.ndarray  # [K] int64 flat index t * N + n of the steps that ended an episode
    done_obs: np.ndarray  # [K, *obs_shape] the final observation of each of those episodes
    last_obs: np.ndarray  # [N, *obs_shape] the observation after the last step
    log_probs: np.ndarray  # [T, N] behaviour log-probabilities (zeros for value-based policies)

    @property
    def env_steps(self) -> int:
        return int(self.rewards.size)

    def steps(self) -> Steps:
        """The rollout as consecutive steps, each with the observation it led to."""
        return Steps(self.obs, self.actions, self.rewards, self.next_obs(), self.terminated, self.truncated)

    def next_obs(self) -> np.ndarray:
        """[T, N, *obs]: the observation each step led to, the final one where an episode ended."""
        following = np.concatenate([self.obs[1:], self.last_obs[None]], axis=0)
        flat = following.reshape(-1, *self.obs.shape[2:]).copy()
        flat[self.done_index] = self.done_obs
        return flat.reshape(self.obs.shape)


class Episodes(NamedTuple):
    """Episodes that ended during a rollout or an evaluation."""

    returns: np.ndarray  # [E] float64 undiscounted
    lengths: np.ndarray  # [E] int64


class Policy(Protocol):
    """The acting side of an agent: numpy observations in, numpy actions out."""

    def act(self, obs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        """(actions [N, ...], log-probabilities [N]) for a batch of observations."""
        ...


class Learner(ABC):
    """The learning side of an agent: it owns networks, optimizers, counters and RNGs."""

    @abstractmethod
    def learn(self, rollouts: Sequence[Rollout], progress: float) -> dict[str, float]:
        """Learn from one iteration's rollouts; `progress` in [0, 1] drives schedules."""

    @abstractmethod
    def policy_weights(self) -> dict[str, torch.Tensor]:
        """The weights a rollout worker needs to act."""

    @abstractmethod
    def load_policy_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Start from another run's policy (a warm start); optimizer and counters stay fresh."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: networks, optimizers, counters, RNG states."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class OnPolicyLearner(Learner):
    """Learns only from rollouts of its current policy (PPO): each iteration's rollouts are
    used once and dropped; there is no replay memory and no heatup."""


class ReplayLearner(Learner):
    """Learns off-policy from a replay memory (DQN, SAC, TD3): rollouts are remembered, and
    training samples the memory. In SYNC mode `learn` remembers one iteration's rollouts, then
    trains its preset's number of steps; in ASYNC mode the caller remembers shards as they land
    and trains as many steps as the ratio of samples to inserts allows. Its `config` has
    `batch_size`, `gamma` and `train_steps_per_iteration`."""

    config: Any
    replay: ReplayMemory
    normalizer: ObservationNormalizer | None = None  # its networks' one normaliser, if they normalise
    n_step: int = 1  # transitions bootstrap after this many rewards (DQN's n-step returns)

    @property
    def samples_per_train_step(self) -> int:
        """Transitions one gradient step samples (the batch size)."""
        return self.config.batch_size

    def remember(self, rollouts: Sequence[Rollout]) -> None:
        """Insert the rollouts' transitions into the replay memory (frames kept once where the
        memory holds images)."""
        for rollout in rollouts:
            self.replay.add_rollout(rollout, self.config.gamma, self.n_step)

    def insert(self, rollouts: Sequence[Rollout]) -> None:
        """New experience: update the observation statistics (where normalising), then remember
        it. A resume rebuilding its memory only remembers: its statistics come with the checkpoint."""
        observe(self.normalizer, (rollout.obs for rollout in rollouts))
        self.remember(rollouts)

    def learn(self, rollouts: Sequence[Rollout], progress: float) -> dict[str, float]:
        self.insert(rollouts)
        return self.train(self.config.train_steps_per_iteration, progress)

    @abstractmethod
    def train(self, steps: int, progress: float) -> dict[str, float]:
        """`steps` gradient steps on samples of the replay memory."""


class VectorEnv(Protocol):
    """What collection needs from a vector of environments (envs.SeededVectorEnv is one)."""

    num_envs: int
    obs: np.ndarray
    action_space: Any

    def step(self, actions: np.ndarray) -> Any: ...


class RandomPolicy:
    """Uniform random actions, for heatup."""

    def __init__(self, action_space: Any, seed: int):
        self.action_space = action_space
        self.rng = np.random.default_rng(seed)

    def act(self, obs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        n = len(obs)
        space = self.action_space
        if hasattr(space, "n"):
            actions = self.rng.integers(0, space.n, size=n)
        else:
            actions = self.rng.uniform(space.low, space.high, size=(n, *space.shape))
            actions = actions.astype(np.float32)
        return actions, np.zeros(n, dtype=np.float32)
