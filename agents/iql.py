"""Implicit Q-learning for continuous actions (Kostrikov, Nair and Levine 2021, "Offline
Reinforcement Learning with Implicit Q-Learning").

IQL never asks its critics about an action the data does not hold. A value network learns an
upper expectile of the target critics' Q over the dataset's actions (expectile regression); the
twin critics learn r + gamma * V(s'); the policy is extracted by advantage-weighted regression:
the log-likelihood of each dataset action, weighted by exp(temperature * (Q - V)), clipped. The
policy is a Gaussian around a tanh mean with a learned, state-independent log std; it acts with
its mean, and samples when exploring (an online run that continues an offline one).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import torch
from gymnasium import spaces
from torch import nn

from gymflow.agents.batches import Sample
from gymflow.agents.configs import IQLConfig
from gymflow.agents.core import AlgorithmParts, ReplayLearner
from gymflow.agents.export import GreedyActions
from gymflow.agents.networks import (
    Adam,
    BoundedActions,
    TransitionBatch,
    TwinCritic,
    TwinCriticCheckpoints,
    cpu_weights,
    mlp,
    seeded_init,
    step_optimizer,
    twin_critic,
    weighted_mean,
)
from gymflow.agents.normalization import observation_normalizer, share_normalizer
from gymflow.agents.replay import ReplayMemory, memory_spec
from gymflow.agents.training_state import SavedWhole

LOG_STD_BOUNDS = (-5.0, 2.0)
ACTION_EDGE = 1.0 - 1e-5  # dataset actions are kept just inside [-1, 1] (actor units)


class GaussianActor(BoundedActions, nn.Module):
    """obs -> a Gaussian over actions in [-1, 1] units: a tanh mean, a learned log std."""

    def __init__(self, inputs: int, hidden: list[int], action_space: spaces.Box, obs_norm: nn.Module):
        super().__init__()
        self.obs_norm = obs_norm
        self.net = mlp(inputs, hidden, int(np.prod(action_space.shape)), nn.ReLU)
        self.log_std = nn.Parameter(torch.zeros(int(np.prod(action_space.shape))))
        self.register_bounds(action_space)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """The mean action, in [-1, 1]."""
        return torch.tanh(self.net(self.obs_norm(obs)))

    def distribution(self, obs: torch.Tensor) -> torch.distributions.Normal:
        return torch.distributions.Normal(self(obs), self.log_std.clamp(*LOG_STD_BOUNDS).exp(), validate_args=False)


def make_actor(config: IQLConfig, observation_space: spaces.Box, action_space: spaces.Box) -> GaussianActor:
    obs_norm = observation_normalizer(config, observation_space.shape)
    return GaussianActor(int(np.prod(observation_space.shape)), config.hidden_sizes, action_space, obs_norm)


class ValueNetwork(nn.Module):
    def __init__(self, inputs: int, hidden: list[int], obs_norm: nn.Module):
        super().__init__()
        self.obs_norm = obs_norm
        self.net = mlp(inputs, hidden, 1, nn.ReLU)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(self.obs_norm(obs)).squeeze(1)


class IQLPolicy:
    """The actor's mean action; a sample of its Gaussian (within [-1, 1]) when exploring."""

    def __init__(self, actor: GaussianActor, seed: int):
        self.actor = actor
        self.rng = np.random.default_rng(seed)

    @torch.inference_mode()
    def act(self, obs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        mean = self.actor(torch.from_numpy(obs)).numpy()
        if explore:
            std = self.actor.log_std.clamp(*LOG_STD_BOUNDS).exp().numpy()
            mean = np.clip(mean + std * self.rng.standard_normal(mean.shape), -1.0, 1.0)
        actions = self.actor.to_env(torch.from_numpy(np.asarray(mean, np.float32))).numpy()
        return actions.astype(np.float32), np.zeros(len(obs), dtype=np.float32)


def expectile_loss(differences: torch.Tensor, expectile: float) -> torch.Tensor:
    """Asymmetric squared error: |expectile - 1(u < 0)| * u^2, averaged. Pure."""
    weight = torch.where(differences > 0, expectile, 1.0 - expectile)
    return (weight * differences.pow(2)).mean()


def value_loss(value: ValueNetwork, target_critic: TwinCritic, batch: TransitionBatch, expectile: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the value's expectile loss against min(Q1', Q2')(s, a), the advantages Q' - V, detached)."""
    with torch.no_grad():
        target_q = torch.min(*target_critic(batch.obs, batch.actions))
    values = value(batch.obs)
    advantages = target_q - values
    return expectile_loss(advantages, expectile), advantages.detach()


def critic_loss(critic: TwinCritic, value: ValueNetwork, batch: TransitionBatch) -> torch.Tensor:
    """The twin critics' squared error against r + gamma^n V(s') (0 past a terminal state)."""
    with torch.no_grad():
        targets = batch.rewards + batch.discounts * value(batch.next_obs)
    q1, q2 = critic(batch.obs, batch.actions)
    return weighted_mean((q1 - targets).pow(2) + (q2 - targets).pow(2), batch.weights)


def actor_loss(actor: GaussianActor, batch: TransitionBatch, advantages: torch.Tensor, config: IQLConfig
               ) -> torch.Tensor:
    """Advantage-weighted regression: -exp(temperature * A) * log pi(a | s), weights clipped."""
    weights = torch.exp(config.temperature * advantages).clamp(max=config.max_weight)
    log_probs = actor.distribution(batch.obs).log_prob(batch.actions).sum(dim=1)
    return -(weights * log_probs).mean()


class IQLLearner(TwinCriticCheckpoints, SavedWhole, ReplayLearner):
    TRAINING_STATE = ("actor", "critic", "target_critic", "value", "actor_optimizer", "critic_optimizer",
                      "value_optimizer", "rng", "train_steps")

    def __init__(self, config: IQLConfig, observation_space: spaces.Box, action_space: spaces.Box, seed: int,
                 device: str = "cpu"):
        self.config = config
        self.device = torch.device(device)
        with seeded_init(seed):
            self.actor = make_actor(config, observation_space, action_space)
            self.critic = twin_critic(config, config.hidden_sizes, observation_space, action_space)
            self.value = ValueNetwork(int(np.prod(observation_space.shape)), config.hidden_sizes,
                                      observation_normalizer(config, observation_space.shape))
        for network in (self.actor, self.critic, self.value):
            network.to(self.device)
        self.target_critic = copy.deepcopy(self.critic).requires_grad_(False)
        self.normalizer = share_normalizer(self.actor, self.critic, self.target_critic, self.value)
        self.actor_optimizer = Adam(self.actor.parameters(), lr=config.lr)
        self.critic_optimizer = Adam(self.critic.parameters(), lr=config.lr)
        self.value_optimizer = Adam(self.value.parameters(), lr=config.lr)
        self.replay = ReplayMemory(memory_spec(config, observation_space, action_space))
        self.rng = np.random.default_rng(seed)
        self.train_steps = 0

    def policy_weights(self) -> dict[str, torch.Tensor]:
        return cpu_weights(self.actor)

    def load_policy_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.actor.load_state_dict(weights)

    def update(self, sample: Sample) -> dict[str, float]:
        """The value's expectile step, the critics' step towards it, the actor's weighted step,
        then the target critics' Polyak step."""
        batch = TransitionBatch.on(sample, self.device)
        batch = replace(batch, actions=self.actor.from_env(batch.actions).clamp(-ACTION_EDGE, ACTION_EDGE))
        loss_v, advantages = value_loss(self.value, self.target_critic, batch, self.config.expectile)
        step_optimizer(self.value_optimizer, loss_v)
        loss_q = critic_loss(self.critic, self.value, batch)
        step_optimizer(self.critic_optimizer, loss_q)
        loss_pi = actor_loss(self.actor, batch, advantages, self.config)
        step_optimizer(self.actor_optimizer, loss_pi)
        with torch.no_grad():
            torch._foreach_lerp_(list(self.target_critic.parameters()), list(self.critic.parameters()),
                                 self.config.tau)
        self.train_steps += 1
        return {"value_loss": loss_v.item(), "critic_loss": loss_q.item(), "actor_loss": loss_pi.item(),
                "advantage_mean": advantages.mean().item()}


PARTS = AlgorithmParts(
    learner=IQLLearner,
    network=make_actor,
    policy=lambda network, config, exploration, seed: IQLPolicy(network, seed),
    greedy=lambda actor, config: GreedyActions(actor, lambda obs: actor.to_env(actor(obs)), discrete=False),
)
