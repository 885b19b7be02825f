"""Random rollouts of given spaces, for learners fed without envs (tests, benchmarks/learner_device.py)."""

from __future__ import annotations

import numpy as np
from gymnasium import spaces

from gymflow.agents.batches import Rollout


def random_rollout(observation_space: spaces.Space, action_space: spaces.Space, steps: int, envs: int,
                   rng: np.random.Generator) -> Rollout:
    """`steps` x `envs` random steps of these spaces, an episode ending every 500 steps."""
    obs = rng.integers(0, 256, (steps, envs, *observation_space.shape), dtype=np.uint8) \
        if observation_space.dtype == np.uint8 else rng.standard_normal((steps, envs, *observation_space.shape),
                                                                        dtype=np.float32)
    if isinstance(action_space, spaces.Discrete):
        actions = rng.integers(0, action_space.n, (steps, envs), dtype=np.int64)
    else:
        actions = rng.uniform(-1, 1, (steps, envs, *action_space.shape)).astype(np.float32)
    terminated = np.zeros((steps, envs), bool)
    terminated[499::500] = True
    done_index = np.flatnonzero(terminated).astype(np.int64)
    return Rollout(obs=obs, actions=actions, rewards=rng.standard_normal((steps, envs), dtype=np.float32),
                   terminated=terminated, truncated=np.zeros((steps, envs), bool), done_index=done_index,
                   done_obs=obs.reshape(-1, *observation_space.shape)[done_index], last_obs=obs[-1],
                   log_probs=np.full((steps, envs), -1.0, np.float32))
