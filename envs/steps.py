"""What every vector env of gymflow's (envs/vector.py's, envs/agents.py's, a C++ backend's) hands
its caller: a step's arrays, and the cursor that says where each env stands."""

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

    def actions_of(self, env_index: int) -> np.ndarray:
        start = int(self.action_counts[:env_index].sum())
        return self.actions[start : start + int(self.action_counts[env_index])]


class VectorStep(NamedTuple):
    obs: np.ndarray  # [N, *obs_shape], next observations (first of a new episode where done)
    rewards: np.ndarray  # [N] float32
    terminated: np.ndarray  # [N] bool
    truncated: np.ndarray  # [N] bool
    done_envs: list[int]  # envs whose episode ended on this step
    done_obs: list[np.ndarray]  # the final observation of each of those episodes
    episode_returns: list[float]  # undiscounted return of each episode that ended
    episode_lengths: list[int]
