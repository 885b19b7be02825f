"""Collection and evaluation: plain functions of a policy and a vector env; and the random
policy heatup collects with.

The same code collects in SYNC rollouts, heatup, evaluation and tests.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gymflow.agents.batches import Episodes, Rollout
from gymflow.agents.core import Policy, VectorEnv


def collect(policy: Policy, env: VectorEnv, steps: int, explore: bool = True,
            learning: np.ndarray | None = None) -> tuple[Rollout, Episodes]:
    """Step every env `steps` times from where it stands; returns the batch and the episodes
    that ended during it. A multi-agent env's rows outside `learning` (a [N] mask: an opponent's)
    act but are no samples: not alive in the batch, their episodes not counted."""
    n = env.num_envs
    obs_shape = env.obs.shape[1:]
    obs = np.empty((steps, n, *obs_shape), dtype=env.obs.dtype)
    actions = np.empty((steps, n, *env.action_space.shape), dtype=_action_dtype(env.action_space))
    log_probs = np.empty((steps, n), dtype=np.float32)
    rewards = np.empty((steps, n), dtype=np.float32)
    terminated = np.empty((steps, n), dtype=bool)
    truncated = np.empty((steps, n), dtype=bool)
    done_index, done_obs, returns, lengths = [], [], [], []  # of the steps that ended an env's episode
    agents = getattr(env, "agents", None)  # a multi-agent env's rows (envs/agents.py): which were in their game
    alive = None if agents is None else np.empty((steps, n), dtype=bool)
    low, high = _action_bounds(env.action_space)
    recurrent = hasattr(policy, "episodes_ended")  # a policy with a memory of each env's episode: the envs keep
    if recurrent:  # it between rollouts, as they keep their cursor
        policy.memory = env.memory
    memory = policy.memory.copy() if recurrent and policy.memory is not None else None
    for t in range(steps):
        obs[t] = env.obs
        if alive is not None:
            alive[t] = env.alive if learning is None else env.alive & learning
        actions[t], log_probs[t] = policy.act(obs[t], explore)
        if recurrent and memory is None:
            memory = np.zeros_like(policy.memory)  # it began with nothing remembered
        env_actions = actions[t] if low is None else np.clip(actions[t], low, high)
        step = env.step(env_actions)
        if recurrent:
            policy.episodes_ended(step.done_envs)
        rewards[t], terminated[t], truncated[t] = step.rewards, step.terminated, step.truncated
        done_index += [t * n + i for i in step.done_envs]
        done_obs += step.done_obs
        returns += step.episode_returns
        lengths += step.episode_lengths
    rollout = Rollout(
        obs=obs, actions=actions, rewards=rewards, terminated=terminated, truncated=truncated,
        done_index=np.asarray(done_index, dtype=np.int64),
        done_obs=np.asarray(done_obs, dtype=env.obs.dtype).reshape(-1, *obs_shape),
        last_obs=env.obs.copy(), log_probs=log_probs, memory=memory,
        agents=None if agents is None else agents.copy(), alive=alive,
    )
    if recurrent:
        env.memory = policy.memory
    counted = slice(None) if learning is None else learning[rollout.done_index % n]  # not an opponent's episodes
    return rollout, Episodes(np.asarray(returns, np.float64)[counted], np.asarray(lengths, np.int64)[counted])


def evaluate(policy: Policy, env: VectorEnv) -> Episodes:
    """Run the first episode of every env to its end, acting greedily; one return per env."""
    n = env.num_envs
    returns = np.full(n, np.nan)
    lengths = np.zeros(n, dtype=np.int64)
    low, high = _action_bounds(env.action_space)
    while np.isnan(returns).any():
        actions, _ = policy.act(env.obs, explore=False)
        step = env.step(actions if low is None else np.clip(actions, low, high))
        if hasattr(policy, "episodes_ended"):
            policy.episodes_ended(step.done_envs)
        for i, episode_return, length in zip(step.done_envs, step.episode_returns, step.episode_lengths):
            if np.isnan(returns[i]):
                returns[i], lengths[i] = episode_return, length
    return Episodes(returns, lengths)


def _action_dtype(space) -> type:
    return np.int64 if not space.shape else np.float32


def _action_bounds(space) -> tuple[np.ndarray | None, np.ndarray | None]:
    if not space.shape:
        return None, None
    return space.low, space.high


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
