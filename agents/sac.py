"""Soft Actor-Critic for continuous actions (Haarnoja et al. 2018, with a learned temperature).

A tanh-squashed Gaussian actor, twin critics with Polyak-averaged targets, and an entropy
coefficient tuned towards a target entropy of -dim(A). Actions are scaled to the env's bounds
inside the actor (its buffers), so a rollout worker needs the actor's weights alone.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import numpy as np
import torch
from gymnasium import spaces
from pydantic import ConfigDict, Field
from torch import nn

from gymflow.agents.core import ReplayLearner, cpu_weights, on_device
from gymflow.agents.networks import BoundedActions, LayerWidths, mlp, seeded_init
from gymflow.agents.normalization import ObservationNormalization, observation_normalizer, share_normalizer
from gymflow.agents.replay import ReplayOptions, Sample, make_replay

LOG_STD_MIN, LOG_STD_MAX = -20.0, 2.0


class SACConfig(ReplayOptions, ObservationNormalization):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    algo: Literal["sac"] = "sac"
    lr: float = Field(default=3e-4, gt=0, le=1, description="Adam learning rate of actor, critics and temperature.")
    gamma: float = Field(default=0.99, gt=0, le=1, description="Discount factor.")
    tau: float = Field(
        default=0.005, gt=0, le=1, description="Polyak step of the target critics after each gradient step."
    )
    batch_size: int = Field(default=256, ge=1, description="Transitions per gradient step.")
    replay_capacity: int = Field(default=1_000_000, ge=1, description="Replay memory size.")
    train_steps_per_iteration: int = Field(
        default=64, ge=1, description="Gradient steps after each iteration's rollouts (TrainingSteps)."
    )
    entropy_coef: float | None = Field(
        default=None, gt=0, description="A fixed entropy coefficient; None learns it towards the target entropy."
    )
    target_entropy: float | None = Field(default=None, description="None: -(number of action dimensions).")
    hidden_sizes: LayerWidths = Field(
        default=[256, 256], min_length=1, description="MLP widths of actor and critics."
    )


class SquashedGaussianActor(BoundedActions, nn.Module):
    """obs -> (mean, log_std) of a Gaussian whose samples are squashed by tanh and scaled to the
    action bounds."""

    def __init__(self, inputs: int, hidden: list[int], action_space: spaces.Box, obs_norm: nn.Module):
        super().__init__()
        self.obs_norm = obs_norm
        self.trunk = mlp(inputs, hidden[:-1], hidden[-1], nn.ReLU)
        self.mean = nn.Linear(hidden[-1], int(np.prod(action_space.shape)))
        self.log_std = nn.Linear(hidden[-1], int(np.prod(action_space.shape)))
        self.register_bounds(action_space)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = torch.relu(self.trunk(self.obs_norm(obs)))
        return self.mean(features), self.log_std(features).clamp(LOG_STD_MIN, LOG_STD_MAX)

    def sample(self, obs: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(squashed actions in [-1, 1], their log-probabilities), reparameterised."""
        mean, log_std = self(obs)
        std = log_std.exp()
        noise = torch.randn(mean.shape, generator=generator).to(mean.device)  # the CPU generator: same draws anywhere
        unsquashed = mean + std * noise
        squashed = torch.tanh(unsquashed)
        gaussian = -0.5 * noise.pow(2) - log_std - 0.5 * np.log(2 * np.pi)
        log_prob = (gaussian - torch.log(1 - squashed.pow(2) + 1e-6)).sum(dim=1)
        return squashed, log_prob


class TwinCritic(nn.Module):
    def __init__(self, obs_size: int, action_size: int, hidden: list[int], obs_norm: nn.Module):
        super().__init__()
        self.obs_norm = obs_norm
        self.q1 = mlp(obs_size + action_size, hidden, 1, nn.ReLU)
        self.q2 = mlp(obs_size + action_size, hidden, 1, nn.ReLU)

    def forward(self, obs: torch.Tensor, squashed_actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.cat([self.obs_norm(obs), squashed_actions], dim=1)
        return self.q1(inputs).squeeze(1), self.q2(inputs).squeeze(1)

    def first(self, obs: torch.Tensor, squashed_actions: torch.Tensor) -> torch.Tensor:
        """Q1 alone (TD3's actor follows it)."""
        return self.q1(torch.cat([self.obs_norm(obs), squashed_actions], dim=1)).squeeze(1)


def make_actor(config: SACConfig, observation_space: spaces.Box, action_space: spaces.Box) -> SquashedGaussianActor:
    obs_norm = observation_normalizer(config, observation_space.shape)
    return SquashedGaussianActor(int(np.prod(observation_space.shape)), config.hidden_sizes, action_space, obs_norm)


class SACPolicy:
    """Samples the squashed Gaussian when exploring, its mean otherwise."""

    def __init__(self, actor: SquashedGaussianActor, seed: int):
        self.actor = actor
        self.rng = np.random.default_rng(seed)

    @torch.inference_mode()
    def act(self, obs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        mean, log_std = self.actor(torch.from_numpy(obs))
        unsquashed = mean.numpy()
        if explore:
            noise = self.rng.standard_normal(unsquashed.shape).astype(np.float32)
            unsquashed = unsquashed + np.exp(log_std.numpy()) * noise
        actions = self.actor.to_env(torch.tanh(torch.from_numpy(unsquashed))).numpy()
        return actions.astype(np.float32), np.zeros(len(obs), dtype=np.float32)


class SACLearner(ReplayLearner):
    def __init__(self, config: SACConfig, observation_space: spaces.Box, action_space: spaces.Box, seed: int,
                 device: str = "cpu"):
        self.config = config
        self.device = torch.device(device)
        obs_size, action_size = int(np.prod(observation_space.shape)), int(np.prod(action_space.shape))
        with seeded_init(seed):
            self.actor = make_actor(config, observation_space, action_space)
            critic_norm = observation_normalizer(config, observation_space.shape)
            self.critic = TwinCritic(obs_size, action_size, config.hidden_sizes, critic_norm)
        self.actor.to(self.device)
        self.critic.to(self.device)
        self.target_critic = copy.deepcopy(self.critic).requires_grad_(False)
        self.normalizer = share_normalizer(self.actor, self.critic, self.target_critic)
        self.log_entropy_coef = torch.zeros(1, device=self.device, requires_grad=config.entropy_coef is None)
        if config.entropy_coef is not None:
            self.log_entropy_coef.data.fill_(float(np.log(config.entropy_coef)))
        self.target_entropy = config.target_entropy if config.target_entropy is not None else -float(action_size)
        self.actor_optimizer = torch.optim.Adam(self.actor.parameters(), lr=config.lr, fused=True)
        self.critic_optimizer = torch.optim.Adam(self.critic.parameters(), lr=config.lr, fused=True)
        self.entropy_optimizer = torch.optim.Adam([self.log_entropy_coef], lr=config.lr)
        self.replay = make_replay(config.replay_capacity, observation_space.shape, action_space.shape, np.float32,
                                  config)
        self.rng = np.random.default_rng(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.train_steps = 0

    def policy_weights(self) -> dict[str, torch.Tensor]:
        return cpu_weights(self.actor)

    def load_policy_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.actor.load_state_dict(weights)

    def train(self, steps: int, progress: float) -> dict[str, float]:
        rows = [self._update(self.replay.sample(self.config.batch_size, self.rng, progress)) for _ in range(steps)]
        metrics = {key: float(np.mean([row[key] for row in rows])) for key in rows[0]} if rows else {}
        return metrics | {"replay_size": float(len(self.replay)), "train_steps": float(self.train_steps)}

    def _update(self, sample: Sample) -> dict[str, float]:
        batch = sample.transitions
        device = self.device
        obs, next_obs = on_device(batch.obs, device), on_device(batch.next_obs, device)
        actions = self.actor.from_env(on_device(batch.actions, device))
        entropy_coef = self.log_entropy_coef.exp().detach()
        with torch.no_grad():
            next_actions, next_log_prob = self.actor.sample(next_obs, self.generator)
            next_q = torch.min(*self.target_critic(next_obs, next_actions)) - entropy_coef * next_log_prob
            targets = on_device(batch.rewards, device) + on_device(batch.discounts, device) * next_q
        q1, q2 = self.critic(obs, actions)
        weights = on_device(sample.weights, device)
        critic_loss = 0.5 * (weights * ((q1 - targets).pow(2) + (q2 - targets).pow(2))).mean()
        self.critic_optimizer.zero_grad()
        critic_loss.backward()
        self.critic_optimizer.step()
        td_errors = 0.5 * ((q1 - targets).abs() + (q2 - targets).abs())
        self.replay.update_priorities(sample.index, td_errors.detach().cpu().numpy())

        new_actions, log_prob = self.actor.sample(obs, self.generator)
        self.critic.requires_grad_(False)
        actor_loss = (entropy_coef * log_prob - torch.min(*self.critic(obs, new_actions))).mean()
        self.actor_optimizer.zero_grad()
        actor_loss.backward()
        self.actor_optimizer.step()
        self.critic.requires_grad_(True)

        if self.config.entropy_coef is None:
            entropy_loss = -(self.log_entropy_coef * (log_prob.detach() + self.target_entropy)).mean()
            self.entropy_optimizer.zero_grad()
            entropy_loss.backward()
            self.entropy_optimizer.step()
        with torch.no_grad():
            torch._foreach_lerp_(list(self.target_critic.parameters()), list(self.critic.parameters()), self.config.tau)
        self.train_steps += 1
        return {
            "critic_loss": critic_loss.item(),
            "actor_loss": actor_loss.item(),
            "entropy_coef": float(entropy_coef),
            "q_mean": q1.mean().item(),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "actor": self.actor.state_dict(),
            "critic": self.critic.state_dict(),
            "target_critic": self.target_critic.state_dict(),
            "actor_optimizer": self.actor_optimizer.state_dict(),
            "critic_optimizer": self.critic_optimizer.state_dict(),
            "entropy_optimizer": self.entropy_optimizer.state_dict(),
            "log_entropy_coef": self.log_entropy_coef.detach().clone(),
            "rng": self.rng.bit_generator.state,
            "generator": self.generator.get_state(),
            "train_steps": self.train_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.actor.load_state_dict(state["actor"])
        self.critic.load_state_dict(state["critic"])
        self.target_critic.load_state_dict(state["target_critic"])
        self.actor_optimizer.load_state_dict(state["actor_optimizer"])
        self.critic_optimizer.load_state_dict(state["critic_optimizer"])
        self.entropy_optimizer.load_state_dict(state["entropy_optimizer"])
        self.log_entropy_coef.data.copy_(state["log_entropy_coef"])
        self.rng.bit_generator.state = state["rng"]
        self.generator.set_state(state["generator"])
        self.train_steps = int(state["train_steps"])
