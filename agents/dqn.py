"""Deep Q-Networks: a target network, an epsilon-greedy schedule, a replay memory.

Mnih et al. 2015. Each iteration inserts the new transitions, then takes
`train_steps_per_iteration` gradient steps on uniform samples of the replay memory.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from gymnasium import spaces
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.nn import functional as F

from agents.core import Rollout
from agents.networks import mlp, seeded_init
from agents.replay import ReplayMemory, Transitions


class DQNConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    algo: Literal["dqn"] = "dqn"
    lr: float = Field(default=1e-3, gt=0, le=1, description="Adam learning rate.")
    gamma: float = Field(default=0.99, gt=0, le=1, description="Discount factor.")
    batch_size: int = Field(default=64, ge=1, description="Transitions per gradient step.")
    replay_capacity: int = Field(default=100_000, ge=1, description="Replay memory size.")
    train_steps_per_iteration: int = Field(
        default=128, ge=1, description="Gradient steps after each iteration's rollouts (TrainingSteps)."
    )
    target_update_every_train_steps: int = Field(
        default=128, ge=1, description="Copy the online network to the target every this many gradient steps."
    )
    epsilon_start: float = Field(default=1.0, ge=0, le=1, description="Exploration at step 0.")
    epsilon_end: float = Field(default=0.05, ge=0, le=1, description="Exploration after the decay.")
    epsilon_decay_env_steps: int = Field(
        default=10_000, ge=1, description="Environment steps over which epsilon decays linearly."
    )
    max_grad_norm: float = Field(default=10.0, gt=0, description="Gradient clipping norm.")
    hidden_sizes: list[int] = Field(default=[256, 256], min_length=1, description="MLP widths.")


def epsilon_at(config: DQNConfig, env_steps: int) -> float:
    fraction = min(env_steps / config.epsilon_decay_env_steps, 1.0)
    return config.epsilon_start + fraction * (config.epsilon_end - config.epsilon_start)


def make_network(config: DQNConfig, observation_space: spaces.Box, action_space: spaces.Discrete) -> nn.Module:
    return mlp(int(observation_space.shape[0]), config.hidden_sizes, int(action_space.n), nn.ReLU)


class QPolicy:
    """Greedy in the Q-values, with probability epsilon a uniform random action instead."""

    def __init__(self, network: nn.Module, epsilon: float, seed: int):
        self.network = network
        self.epsilon = epsilon
        self.rng = np.random.default_rng(seed)

    @torch.inference_mode()
    def act(self, obs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        q_values = self.network(torch.from_numpy(obs)).numpy()
        actions = q_values.argmax(axis=1)
        if explore and self.epsilon > 0:
            random = self.rng.random(len(obs)) < self.epsilon
            actions = np.where(random, self.rng.integers(0, q_values.shape[1], len(obs)), actions)
        return actions, np.zeros(len(obs), dtype=np.float32)


class DQNLearner:
    def __init__(self, config: DQNConfig, observation_space: spaces.Box, action_space: spaces.Discrete, seed: int):
        self.config = config
        with seeded_init(seed):
            self.q_network = make_network(config, observation_space, action_space)
        self.target_network = copy.deepcopy(self.q_network).requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.q_network.parameters(), lr=config.lr, fused=True)
        self.replay = ReplayMemory(config.replay_capacity, observation_space.shape, (), np.int64)
        self.rng = np.random.default_rng(seed)
        self.train_steps = 0

    def policy_weights(self) -> dict[str, torch.Tensor]:
        return self.q_network.state_dict()

    def load_policy_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.q_network.load_state_dict(weights)
        self.target_network.load_state_dict(weights)

    def remember(self, rollouts: Sequence[Rollout]) -> None:
        for rollout in rollouts:
            self.replay.add(
                Transitions(
                    obs=rollout.obs.reshape(-1, *rollout.obs.shape[2:]),
                    actions=rollout.actions.reshape(-1),
                    rewards=rollout.rewards.reshape(-1),
                    next_obs=rollout.next_obs().reshape(-1, *rollout.obs.shape[2:]),
                    terminated=rollout.terminated.reshape(-1),
                )
            )

    def learn(self, rollouts: Sequence[Rollout], progress: float) -> dict[str, float]:
        self.remember(rollouts)
        losses, q_means = [], []
        for _ in range(self.config.train_steps_per_iteration):
            loss, q_mean = self._update(self.replay.sample(self.config.batch_size, self.rng))
            losses.append(loss)
            q_means.append(q_mean)
            self.train_steps += 1
            if self.train_steps % self.config.target_update_every_train_steps == 0:
                self.target_network.load_state_dict(self.q_network.state_dict())
        return {
            "td_loss": float(np.mean(losses)),
            "q_mean": float(np.mean(q_means)),
            "replay_size": float(len(self.replay)),
            "train_steps": float(self.train_steps),
        }

    def _update(self, batch: Transitions) -> tuple[float, float]:
        obs = torch.from_numpy(batch.obs)
        actions = torch.from_numpy(batch.actions)
        with torch.no_grad():
            next_q = self.target_network(torch.from_numpy(batch.next_obs)).max(dim=1).values
            not_terminal = 1.0 - torch.from_numpy(batch.terminated).float()
            targets = torch.from_numpy(batch.rewards) + self.config.gamma * not_terminal * next_q
        q_taken = self.q_network(obs).gather(1, actions[:, None]).squeeze(1)
        loss = F.smooth_l1_loss(q_taken, targets)
        self.optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(self.q_network.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        return loss.item(), q_taken.mean().item()

    def state_dict(self) -> dict[str, Any]:
        return {
            "q_network": self.q_network.state_dict(),
            "target_network": self.target_network.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": self.rng.bit_generator.state,
            "train_steps": self.train_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.q_network.load_state_dict(state["q_network"])
        self.target_network.load_state_dict(state["target_network"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.rng.bit_generator.state = state["rng"]
        self.train_steps = int(state["train_steps"])
