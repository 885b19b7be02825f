"""The roles algorithms play for the rest of gymflow: a policy acts, a learner learns, and a
replay learner keeps the experience it learns from. Roles only: no torch, no memory, no
normaliser, and nothing about Prefect, Dask, storage or MLflow. The batches they exchange are
in agents/batches.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from gymflow.agents.batches import Rollout, Sample


class Policy(Protocol):
    """The acting side of an agent: numpy observations in, numpy actions out."""

    def act(self, obs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        """(actions [N, ...], log-probabilities [N]) for a batch of observations."""
        ...


class ActsFromOutputs(Protocol):
    """A policy whose action is a choice from its network's outputs: where jobs in one process
    act with one network, its outputs for all their rows are computed once
    (`agents.rollout.collect_together`). `act(obs)` is `act_on(obs, outputs(obs))`."""

    network: Any

    def outputs(self, obs: np.ndarray) -> np.ndarray:
        """The network's outputs for a batch of observations, a row each."""
        ...

    def act_on(self, obs: np.ndarray, outputs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        """(actions, log-probabilities) from the rows' `outputs`, as `act` returns them."""
        ...


class OutputsSource(Protocol):
    """Where a policy's network outputs are computed away from its env-stepping process, in
    order: each `receive` answers the oldest `request` not yet answered."""

    def request(self, obs: np.ndarray) -> None:
        """Ask for the outputs of a batch of observations (the array is read before the answer)."""
        ...

    def receive(self) -> np.ndarray:
        """The outputs of the oldest batch asked for, a row each."""
        ...


class Learner(ABC):
    """The learning side of an agent: it owns networks, optimizers, counters and RNGs."""

    # agents/data_parallel.py's Ranks while it learns as one of several ranks (distribution.learners; `join`);
    # None: alone, the learner it always was
    ranks: Any = None

    def join(self, ranks: Any) -> None:
        """Learn from now on as one of `ranks` (None: alone again): the same batches on every rank,
        each computing the gradients of its share of their rows."""
        self.ranks = ranks

    @abstractmethod
    def learn(self, rollouts: Sequence[Rollout], progress: float, streams: Sequence[int] | None = None
              ) -> dict[str, float]:
        """Learn from one iteration's rollouts; `progress` in [0, 1] drives schedules; `streams`:
        the rollout worker whose envs each rollout continues (None: the i-th rollout, worker i)."""

    @abstractmethod
    def policy_weights(self) -> dict[str, Any]:
        """The weights a rollout worker needs to act (CPU tensors)."""

    @abstractmethod
    def load_policy_weights(self, weights: dict[str, Any]) -> None:
        """Start from another run's policy (a warm start); optimizer and counters stay fresh."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: networks, optimizers, counters, RNG states."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Memory(Protocol):
    """What a replay learner's memory does for the loop (agents/replay.py has the memories)."""

    capacity: int
    keeps_priorities: bool  # sampling depends on what training says of each transition (prioritized replay)

    def add(self, rollout: Rollout) -> np.ndarray:
        """Keep a rollout's transitions; returns the slots they took."""
        ...

    def __len__(self) -> int: ...

    def sample(self, batch_size: int, rng: np.random.Generator, progress: float) -> Sample: ...

    def update_priorities(self, index: np.ndarray, td_errors: np.ndarray) -> None: ...

    def priorities(self) -> dict[str, np.ndarray]:
        """What training (not inserting) changes in the memory, copied: prioritized replay's priorities."""
        ...

    def load_priorities(self, saved: dict[str, np.ndarray]) -> None: ...

    def bytes_per_transition(self) -> float: ...

    def position(self) -> dict[str, int]: ...

    def start_before(self, position: dict[str, int], rollouts: Sequence[Rollout]) -> None: ...

    def state_dict(self) -> dict[str, np.ndarray]: ...


class Statistics(Protocol):
    """Running observation statistics a learner's networks normalise with."""

    def observe(self, observations: Iterable[np.ndarray]) -> None: ...


class ReplayLearner(Learner):
    """Learns off-policy from a replay memory (DQN, SAC, TD3): experience goes in through
    `insert`, and training samples the memory. In SYNC mode `learn` inserts one iteration's
    rollouts, then trains its preset's number of steps; in ASYNC mode the caller inserts shards
    as they land and trains as many steps as the ratio of samples to inserts allows. Its `config`
    has `batch_size` and `train_steps_per_iteration`."""

    config: Any
    replay: Memory
    rng: np.random.Generator  # draws the samples
    train_steps: int
    normalizer: Statistics | None = None  # its networks' one set of statistics, if they normalise

    @property
    def samples_per_train_step(self) -> int:
        """Transitions one gradient step samples (the batch size)."""
        return self.config.batch_size

    def insert(self, rollouts: Sequence[Rollout]) -> None:
        """New experience: the observation statistics move (where normalising), then the memory
        keeps it. A resume rebuilding its memory adds to `replay` alone: its statistics come
        with the checkpoint."""
        if self.normalizer is not None:
            self.normalizer.observe(rollout.obs for rollout in rollouts)
        for rollout in rollouts:
            self.replay.add(rollout)

    def learn(self, rollouts: Sequence[Rollout], progress: float, streams: Sequence[int] | None = None
              ) -> dict[str, float]:
        self.insert(rollouts)
        return self.train(self.config.train_steps_per_iteration, progress)

    def train(self, steps: int, progress: float) -> dict[str, float]:
        """`steps` gradient steps on samples of the replay memory; `progress` anneals the
        importance-weight exponent of prioritized replay. Metrics are means over the steps that
        reported them."""
        batch_size = self.config.batch_size
        rows = [self._update_shared(self.replay.sample(batch_size, self.rng, progress)) for _ in range(steps)]
        keys = dict.fromkeys(key for row in rows for key in row)
        metrics = {key: float(np.mean([row[key] for row in rows if key in row])) for key in keys}
        if self.ranks is not None:  # each rank's of its own rows
            metrics = self.ranks.mean(metrics, self.ranks.rows_in([batch_size] * steps))
        return metrics | {"replay_size": float(len(self.replay)), "train_steps": float(self.train_steps),
                          "replay_bytes_per_transition": self.replay.bytes_per_transition()}

    def _update_shared(self, sample: Sample) -> dict[str, float]:
        """`update` alone, or as one of several ranks: each its share of the sample's rows."""
        if self.ranks is None:
            return self.update(sample)
        share = self.ranks.share(len(sample.index))
        return self.update(sample, share)

    def reprioritize(self, sample: Sample, td_errors: Callable[[], Any], share: Any = None) -> None:
        """The sampled transitions' new priorities from their TD errors (a tensor, asked for only where
        the memory keeps priorities; `share`'s rows of them where the ranks share the sample out:
        gathered whole, as every rank's memory takes them)."""
        if not self.replay.keeps_priorities:
            return
        errors = td_errors().cpu().numpy()
        self.replay.update_priorities(sample.index, errors if share is None else share.gathered(errors))

    @abstractmethod
    def update(self, sample: Sample, share: Any = None) -> dict[str, float]:
        """One update from a sample: compute the losses, step the optimisers, count. With `share`
        (agents/data_parallel.py's, one of several ranks), the losses are of its rows only and
        the gradients are averaged over the ranks before the optimisers step."""


class AlgorithmParts(NamedTuple):
    """What an algorithm's module builds (agents/algorithms.py finds it as the module's PARTS)."""

    learner: Callable[..., Learner]  # (config, observation_space, action_space, seed, device)
    network: Callable[..., Any]  # (config, observation_space, action_space) -> the acting nn.Module
    policy: Callable[..., Policy]  # (network, config, exploration, seed)
    # (network, config) -> the nn.Module from observations to the actions the policy takes when not exploring
    # (agents/export.py's GreedyActions), or CannotExport where the network cannot be one graph; None: not yet
    greedy: Callable[..., Any] | None = None


class VectorEnv(Protocol):
    """What collection needs from a vector of environments (envs.SeededVectorEnv is one)."""

    num_envs: int
    obs: np.ndarray
    action_space: Any

    def step(self, actions: np.ndarray) -> Any: ...
