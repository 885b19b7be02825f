"""The batches experience moves in, from the envs to the learner: numpy arrays, nothing else.

A rollout worker collects a `Rollout` (T steps of N envs) and the `Episodes` that ended in it;
a replay memory turns a rollout's `Steps` into n-step `Transitions` and hands back `Sample`s of
them. This module imports numpy alone, so that anything may name these types.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Steps(NamedTuple):
    """T consecutive steps of N envs, with the observation each step led to."""

    obs: np.ndarray  # [T, N, *obs_shape]
    actions: np.ndarray  # [T, N, *action_shape]
    rewards: np.ndarray  # [T, N]
    next_obs: np.ndarray  # [T, N, *obs_shape]: the final observation where an episode ended
    terminated: np.ndarray  # [T, N] bool
    truncated: np.ndarray  # [T, N] bool


class Rollout(NamedTuple):
    """T steps of N envs, as one rollout worker collected them."""

    obs: np.ndarray  # [T, N, *obs_shape]
    actions: np.ndarray  # [T, N, *action_shape] what the envs were sent (a C++ backend's FIRE where it sent that)
    rewards: np.ndarray  # [T, N] float32
    terminated: np.ndarray  # [T, N] bool: a terminal state (an episode's end, or an Atari life lost in training)
    truncated: np.ndarray  # [T, N] bool: the episode was cut (time limit); bootstrap from it
    done_index: np.ndarray  # [K] int64 flat index t * N + n of the steps that ended an episode
    done_obs: np.ndarray  # [K, *obs_shape] the final observation of each of those episodes
    last_obs: np.ndarray  # [N, *obs_shape] the observation after the last step
    log_probs: np.ndarray  # [T, N] behaviour log-probabilities (zeros for value-based policies)
    memory: np.ndarray | None = None  # [2, N, H] a recurrent policy's memory (LSTM h, c) where it began
    agents: np.ndarray | None = None  # [N] int64 where each env is one agent of a game (envs/agents.py): its index
    # [T, N] bool: a sample of the policy's. With agents, the agent was in its game (left agents' rows idle);
    # on a C++ backend that serves FIRE (envs/batched.py), the env was sent the policy's action, not a press
    alive: np.ndarray | None = None

    @property
    def env_steps(self) -> int:
        """Steps of the envs; where each agent of a game is a row, the game's joint steps."""
        games = self.rewards.shape[1] if self.agents is None else int(np.count_nonzero(self.agents == 0))
        return int(self.rewards.shape[0] * games)

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


class Transitions(NamedTuple):
    obs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray  # the (n-step) discounted reward sum
    next_obs: np.ndarray  # the observation to bootstrap from
    discounts: np.ndarray  # gamma^k of the bootstrap; 0 where the episode terminated


class Sample(NamedTuple):
    """A batch drawn from a memory: the transitions, where they sit, and their importance weights
    (None for uniform replay: all ones, left out of the losses)."""

    transitions: Transitions
    index: np.ndarray
    weights: np.ndarray | None
