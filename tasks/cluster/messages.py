"""The messages between the flow and the jobs it runs on workers (tasks/cluster/jobs.py): small
frozen dataclasses that name what to do and say what came of it. Nothing heavier than numpy and
gymnasium's spaces: the flow's side imports them without the jobs' torch and envs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from gymnasium import spaces

from gymflow.envs.make import Preprocessing
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import StorageLocation


@dataclass(frozen=True)
class InferenceAddress:
    """Where a run's inference server listens: only workers on its machine reach it."""

    path: str  # the Unix socket
    authkey: bytes
    machine: str  # where it runs: host name and boot id (tasks/cluster/inference.py's `this_machine`)


@dataclass(frozen=True)
class RolloutSpec:
    """One worker's share of one round of collection."""

    storage: StorageLocation
    run_id: str
    env_id: str
    env_kwargs: dict[str, Any]
    preprocessing: Preprocessing  # the training envs' wrappers
    agent: Any  # the agent's pydantic config
    # None: uniform random (heatup); "newest": the newest committed when the job starts (async)
    policy_version: int | Literal["newest"] | None
    worker: int
    num_envs: int
    steps_per_env: int
    env_seed: int  # fixed for the worker over the run: episode k of env i is seeded from it
    policy_seed: int  # fresh for each (version, worker): exploration noise
    exploration: float
    resume_from: str | None  # the shard whose env cursor this round continues from
    chunk: int | None = None  # async: this worker's chunk number, which names its shard
    opponent_version: int | None = None  # two-player self-play: a past version playing one side of each game
    inference: InferenceAddress | None = None  # a server beside the learner that computes the outputs it acts on
    backend: str = "gymnasium"  # what steps the envs: gymnasium, envpool or ale (envs/*_backend.py)
    env_threads: int = 1  # the C++ backend's threads that step them

    @property
    def shard_key(self) -> str:
        if self.chunk is not None:
            return RunLayout(self.run_id).chunk(self.worker, self.chunk)
        assert self.policy_version != "newest"
        return RunLayout(self.run_id).shard(self.policy_version, self.worker)


@dataclass(frozen=True)
class EvaluationSpec:
    storage: StorageLocation
    run_id: str
    env_id: str
    env_kwargs: dict[str, Any]
    preprocessing: Preprocessing  # the evaluation envs' wrappers
    agent: Any
    policy_version: int
    episodes: int
    seed: int  # the same at every evaluation of a run, so evaluations compare
    film: bool = False  # after its episodes, film its first one again into the run's videos/
    opponent: str = "itself"  # two-player games: "random" plays a random player, a game's return being its score
    held_out: HeldOutSource | None = None  # schedule.evaluate_on decisions: scored on these, no episode played


@dataclass(frozen=True)
class HeldOutSource:
    """A decision log's held-out decisions for selection (dataset.holdout's first half, logged before
    `before`), `part` of `parts` of them: each worker scores a part."""

    location: StorageLocation
    share: float
    before: float | None
    part: int = 0
    parts: int = 1


@dataclass(frozen=True)
class Film:
    """An episode of the evaluated policy on video, in the run's storage."""

    key: str  # the MP4's storage key
    frames: int
    episode_return: float


@dataclass(frozen=True)
class EvaluationResult:
    version: int
    returns: tuple[float, ...]
    lengths: tuple[int, ...]
    seconds: float
    film: Film | None = None
    no_film: str = ""  # why a film that was asked for is missing
    groups: tuple[str, ...] = ()  # a PettingZoo env's: the agent group of each return (envs/agents.py)

    @property
    def mean_return(self) -> float:
        return float(np.mean(self.returns))

    def group_returns(self) -> dict[str, np.ndarray]:
        """Each agent group's returns; {} where one agent plays each episode."""
        returns, groups = np.asarray(self.returns), np.asarray(self.groups)
        return {group: returns[groups == group] for group in dict.fromkeys(self.groups)}


@dataclass(frozen=True)
class WorkerCheckSpec:
    """What a worker must be able to do before a run's first job: make its env, with the spaces
    the flow found."""

    env_id: str
    env_kwargs: dict[str, Any]
    preprocessing: Preprocessing
    algo: str
    action_spaces: tuple[type[spaces.Space], ...]
    images: bool
    observation_space: spaces.Space
    action_space: spaces.Space
    storage: StorageLocation
    backend: str = "gymnasium"  # what steps the rollouts' envs there (RolloutSpec.backend)


@dataclass(frozen=True)
class WorkerCheck:
    worker: str  # its address
    field: str = ""  # the preset field the problem is about
    problem: str = ""  # empty: it can
