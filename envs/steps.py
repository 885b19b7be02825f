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


SAMPLED_EVERY = 4  # the steps of a rollout whose observations are checked against the space: one in this many


def observations_outside(space: Any, observations: np.ndarray) -> str | None:
    """Where a rollout's float observations ([T, N, *shape], every SAMPLED_EVERY-th step) leave the
    finite bounds their Box declares: the entry furthest outside, its value and the bound, in words
    (None where all fit, to float32's rounding, or the space has no finite bounds to leave)."""
    if not hasattr(space, "low") or np.issubdtype(observations.dtype, np.integer) or observations.size == 0:
        return None
    sampled = observations[::SAMPLED_EVERY].reshape(-1, *space.shape)
    low, high = np.asarray(space.low, np.float64), np.asarray(space.high, np.float64)
    slack = 1e-5 * (1.0 + np.maximum(np.abs(low), np.abs(high)))
    below = np.where(np.isfinite(low), low - sampled.min(axis=0), -np.inf)
    above = np.where(np.isfinite(high), sampled.max(axis=0) - high, -np.inf)
    outside = np.maximum(below, above) - slack
    if not (outside > 0).any():
        return None
    worst = np.unravel_index(int(np.argmax(outside)), outside.shape)
    entry = worst[0] if len(worst) == 1 else worst
    if below[worst] >= above[worst]:
        return f"entry {entry} reached {float(sampled.min(axis=0)[worst]):.4g}, below its low {low[worst]:.4g}"
    return f"entry {entry} reached {float(sampled.max(axis=0)[worst]):.4g}, above its high {high[worst]:.4g}"
