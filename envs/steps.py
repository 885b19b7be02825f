"""What every vector env of gymflow's (envs/vector.py's, envs/agents.py's, a C++ backend's) hands
its caller: a step's arrays, and the cursor that says where each env stands; and what steps them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np


def observation_dtype(space: Any) -> type:
    """How observations are kept: images as their uint8, everything else as float32."""
    return np.uint8 if space.dtype == np.uint8 else np.float32


@dataclass(frozen=True)
class EnvCursor:
    """Where each env stands: its episode index and the actions taken since that episode began."""

    episode_index: np.ndarray  # [N] int64
    action_counts: np.ndarray  # [N] int64
    actions: np.ndarray  # [sum(action_counts), *action_shape]
    memory: np.ndarray | None = None  # [2, N, H] a recurrent policy's memory of the envs (None: none kept)
    # where an env's episodes do not each start from a seed (envs/ale_backend.py): the episodes it ended
    # since its last seeded start, and their actions, which a replay plays first (None: every episode seeded)
    prelude_episodes: np.ndarray | None = None  # [N] int64
    prelude_counts: np.ndarray | None = None  # [N] int64
    prelude_actions: np.ndarray | None = None  # [sum(prelude_counts), *action_shape]

    def actions_of(self, env_index: int) -> np.ndarray:
        return _part(self.actions, self.action_counts, env_index)

    def prelude_of(self, env_index: int) -> np.ndarray:
        """The actions of the episodes env `env_index` ended since its last seeded start (maybe none)."""
        if self.prelude_counts is None or self.prelude_actions is None:
            return self.actions[:0]
        return _part(self.prelude_actions, self.prelude_counts, env_index)


def _part(flat: np.ndarray, counts: np.ndarray, env_index: int) -> np.ndarray:
    start = int(counts[:env_index].sum())
    return flat[start : start + int(counts[env_index])]


@dataclass(frozen=True)
class Backend:
    """What steps a worker's envs: gymnasium (each in Python), or a C++ backend, envpool or ale, on
    `threads` threads."""

    name: str = "gymnasium"
    threads: int = 1


class VectorStep(NamedTuple):
    obs: np.ndarray  # [N, *obs_shape], next observations (first of a new episode where done)
    rewards: np.ndarray  # [N] float32
    terminated: np.ndarray  # [N] bool
    truncated: np.ndarray  # [N] bool
    done_envs: list[int]  # envs whose episode ended on this step
    done_obs: list[np.ndarray]  # the final observation of each of those episodes
    episode_returns: list[float]  # undiscounted return of each episode that ended
    episode_lengths: list[int]
