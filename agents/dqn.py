"""Deep Q-Networks: a target network, an epsilon-greedy schedule, a replay memory.

Mnih et al. 2015, with the usual options: double Q-learning (van Hasselt et al. 2016), dueling
heads (Wang et al. 2016), n-step returns and prioritized replay (Schaul et al. 2016). SYNC: each
iteration inserts the new transitions, then takes `train_steps_per_iteration` gradient steps.
ASYNC: the caller inserts (`remember`) and trains (`train`) at its own ratio.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import numpy as np
import torch
from gymnasium import spaces
from pydantic import ConfigDict, Field
from torch import nn
from torch.nn import functional as F

from gymflow.agents.core import ReplayLearner, cpu_weights, on_device
from gymflow.agents.networks import LayerWidths, mlp, observation_reader, seeded_init
from gymflow.agents.normalization import ObservationNormalization, observation_normalizer, share_normalizer
from gymflow.agents.replay import ReplayOptions, Sample, make_replay
from gymflow.envs.vector import observation_dtype


class DQNConfig(ReplayOptions, ObservationNormalization):
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
    hidden_sizes: LayerWidths = Field(default=[256, 256], min_length=1, description="MLP widths.")
    double_q: bool = Field(
        default=False, description="Double Q-learning: the online network picks the next action, the target values it."
    )
    dueling: bool = Field(default=False, description="Dueling heads: Q = V + A - mean(A).")
    n_step: int = Field(default=1, ge=1, le=100, description="Bootstrap after this many rewards (n-step returns).")


def epsilon_at(config: DQNConfig, env_steps: int) -> float:
    fraction = min(env_steps / config.epsilon_decay_env_steps, 1.0)
    return config.epsilon_start + fraction * (config.epsilon_end - config.epsilon_start)


class DuelingQNetwork(nn.Module):
    """A shared trunk, then a state value and action advantages: Q = V + A - mean(A)."""

    def __init__(self, inputs: int, hidden: list[int], actions: int, obs_norm: nn.Module):
        super().__init__()
        self.obs_norm = obs_norm
        self.trunk = mlp(inputs, hidden[:-1], hidden[-1], nn.ReLU) if len(hidden) > 1 else nn.Linear(inputs, hidden[0])
        self.value = nn.Linear(hidden[-1], 1)
        self.advantage = nn.Linear(hidden[-1], actions)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        features = torch.relu(self.trunk(self.obs_norm(obs)))
        advantage = self.advantage(features)
        return self.value(features) + advantage - advantage.mean(dim=1, keepdim=True)


def make_network(config: DQNConfig, observation_space: spaces.Box, action_space: spaces.Discrete) -> nn.Module:
    """An MLP of Q-values over the observations (images: over the CNN's features)."""
    reader, inputs = observation_reader(observation_normalizer(config, observation_space.shape), observation_space)
    actions = int(action_space.n)
    if config.dueling:
        return DuelingQNetwork(inputs, config.hidden_sizes, actions, reader)
    q_values = mlp(inputs, config.hidden_sizes, actions, nn.ReLU)
    return q_values if isinstance(reader, nn.Identity) else nn.Sequential(reader, *q_values)


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


class DQNLearner(ReplayLearner):
    def __init__(self, config: DQNConfig, observation_space: spaces.Box, action_space: spaces.Discrete, seed: int,
                 device: str = "cpu"):
        self.config = config
        self.device = torch.device(device)
        with seeded_init(seed):
            self.q_network = make_network(config, observation_space, action_space).to(self.device)
        self.target_network = copy.deepcopy(self.q_network).requires_grad_(False)
        self.normalizer = share_normalizer(self.q_network, self.target_network)
        self.optimizer = torch.optim.Adam(self.q_network.parameters(), lr=config.lr, fused=True)
        self.replay = make_replay(config.replay_capacity, observation_space.shape, (), np.int64, config,
                                  observation_dtype(observation_space))
        self.rng = np.random.default_rng(seed)
        self.train_steps = 0

    def policy_weights(self) -> dict[str, torch.Tensor]:
        return cpu_weights(self.q_network)

    def load_policy_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.q_network.load_state_dict(weights)
        self.target_network.load_state_dict(weights)

    @property
    def n_step(self) -> int:
        return self.config.n_step

    def train(self, steps: int, progress: float) -> dict[str, float]:
        """`steps` gradient steps on samples of the replay memory; `progress` anneals the
        importance-weight exponent of prioritized replay."""
        losses, q_means = [], []
        for _ in range(steps):
            loss, q_mean = self._update(self.replay.sample(self.config.batch_size, self.rng, progress))
            losses.append(loss)
            q_means.append(q_mean)
            self.train_steps += 1
            if self.train_steps % self.config.target_update_every_train_steps == 0:
                self.target_network.load_state_dict(self.q_network.state_dict())
        return {
            "td_loss": float(np.mean(losses)) if losses else float("nan"),
            "q_mean": float(np.mean(q_means)) if q_means else float("nan"),
            "replay_size": float(len(self.replay)),
            "replay_bytes_per_transition": self.replay.bytes_per_transition(),
            "train_steps": float(self.train_steps),
        }

    def _update(self, sample: Sample) -> tuple[float, float]:
        batch = sample.transitions
        device = self.device
        obs = on_device(batch.obs, device)
        actions = on_device(batch.actions, device)
        with torch.no_grad():
            next_obs = on_device(batch.next_obs, device)
            next_target_q = self.target_network(next_obs)
            if self.config.double_q:
                next_actions = self.q_network(next_obs).argmax(dim=1, keepdim=True)
                next_q = next_target_q.gather(1, next_actions).squeeze(1)
            else:
                next_q = next_target_q.max(dim=1).values
            targets = on_device(batch.rewards, device) + on_device(batch.discounts, device) * next_q
        q_taken = self.q_network(obs).gather(1, actions[:, None]).squeeze(1)
        weights = on_device(sample.weights, device)
        loss = (weights * F.smooth_l1_loss(q_taken, targets, reduction="none")).mean()
        self.optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(self.q_network.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.replay.update_priorities(sample.index, (targets - q_taken).detach().cpu().numpy())
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
