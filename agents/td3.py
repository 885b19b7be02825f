"""Twin Delayed DDPG for continuous actions (Fujimoto et al. 2018, "Addressing Function
Approximation Error in Actor-Critic Methods").

A deterministic actor explores with Gaussian noise. The critics learn from the smaller of two
target critics (clipped double-Q), evaluated at a smoothed target action: the target actor's
action plus clipped noise (target policy smoothing). The actor and the target networks move only
every `policy_delay` critic steps. As SAC's, the actor scales its tanh output to the env's
bounds itself (its buffers), so a rollout worker needs the actor's weights alone.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import torch
from gymnasium import spaces
from torch import nn

from gymflow.agents.batches import Sample
from gymflow.agents.configs import TD3Config
from gymflow.agents.core import AlgorithmParts, ReplayLearner
from gymflow.agents.data_parallel import Share
from gymflow.agents.export import GreedyActions
from gymflow.agents.networks import (
    Adam,
    BoundedActions,
    InplaceReLU,
    TransitionBatch,
    TwinCritic,
    TwinCriticCheckpoints,
    cpu_weights,
    mlp,
    observation_reader,
    seeded_init,
    step_optimizer,
    twin_critic,
    twin_td_errors,
    weighted_mean,
)
from gymflow.agents.normalization import share_normalizer
from gymflow.agents.replay import make_replay, memory_spec
from gymflow.agents.training_state import SavedWhole


class DeterministicActor(BoundedActions, nn.Module):
    """obs -> an action in [-1, 1] (tanh), which `to_env` scales to the env's bounds."""

    def __init__(self, inputs: int, hidden: list[int], action_space: spaces.Box, obs_norm: nn.Module):
        super().__init__()
        self.obs_norm = obs_norm
        self.net = mlp(inputs, hidden, int(np.prod(action_space.shape)), InplaceReLU)
        self.register_bounds(action_space)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.net(self.obs_norm(obs)))


def make_actor(config: TD3Config, observation_space: spaces.Box, action_space: spaces.Box) -> DeterministicActor:
    """The actor, with an observation reader of its own (a CNN of its own for images)."""
    reader, width = observation_reader(config, observation_space)
    return DeterministicActor(width, config.hidden_sizes, action_space, reader)


class TD3Policy:
    """The actor's action, plus Gaussian noise when exploring, within [-1, 1] before scaling."""

    def __init__(self, actor: DeterministicActor, noise: float, seed: int):
        self.actor = actor
        self.noise = noise
        self.rng = np.random.default_rng(seed)

    @torch.inference_mode()
    def act(self, obs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        squashed = self.actor(torch.from_numpy(obs)).numpy()
        if explore and self.noise > 0:
            squashed = np.clip(squashed + self.noise * self.rng.standard_normal(squashed.shape), -1.0, 1.0)
        actions = self.actor.to_env(torch.from_numpy(np.asarray(squashed, np.float32))).numpy()
        return actions.astype(np.float32), np.zeros(len(obs), dtype=np.float32)


def smoothed_target_actions(target_actor: DeterministicActor, next_obs: torch.Tensor, noise: torch.Tensor,
                            config: TD3Config) -> torch.Tensor:
    """Target policy smoothing: pi'(s') + clip(noise * sigma, -c, c), kept within [-1, 1]. `noise`
    is standard normal, drawn by the caller (a generator of the learner's own)."""
    smoothing = (noise * config.target_noise).clamp(-config.target_noise_clip, config.target_noise_clip)
    return (target_actor(next_obs) + smoothing).clamp(-1.0, 1.0)


def critic_targets(target_critic: TwinCritic, target_actions: torch.Tensor, batch: TransitionBatch) -> torch.Tensor:
    """Clipped double-Q: y = r + gamma^n * min(Q1', Q2')(s', a')."""
    with torch.no_grad():
        return batch.rewards + batch.discounts * target_critic.both(batch.next_obs, target_actions).amin(0)


def critic_loss(critic: TwinCritic, batch: TransitionBatch, targets: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the twin critics' weighted squared error, their errors Q - y [2, B] detached, Q1); batch
    actions in the actor's [-1, 1] units. Pure."""
    values = critic.both(batch.obs, batch.actions)  # [2, B]
    errors = values - targets
    loss = weighted_mean(errors.pow(2).sum(0), batch.weights)
    return loss, errors.detach(), values[0].detach()


def actor_loss(actor: DeterministicActor, critic: TwinCritic, obs: torch.Tensor) -> torch.Tensor:
    """The deterministic policy gradient's objective: -Q1(s, pi(s))."""
    return -critic.first(obs, actor(obs)).mean()


class TD3Learner(TwinCriticCheckpoints, SavedWhole, ReplayLearner):
    TRAINING_STATE = ("actor", "critic", "target_actor", "target_critic", "actor_optimizer",
                      "critic_optimizer", "rng", "generator", "train_steps")

    def __init__(self, config: TD3Config, observation_space: spaces.Box, action_space: spaces.Box, seed: int,
                 device: str = "cpu"):
        self.config = config
        self.device = torch.device(device)
        with seeded_init(seed):
            self.actor = make_actor(config, observation_space, action_space)
            self.critic = twin_critic(config, config.hidden_sizes, observation_space, action_space)
        self.actor.to(self.device)
        self.critic.to(self.device)
        self.target_actor = copy.deepcopy(self.actor).requires_grad_(False)
        self.target_critic = copy.deepcopy(self.critic).requires_grad_(False)
        self.normalizer = share_normalizer(self.actor, self.critic, self.target_actor, self.target_critic)
        self.actor_optimizer = Adam(self.actor.parameters(), lr=config.lr, fused=True)
        self.critic_optimizer = Adam(self.critic.parameters(), lr=config.lr, fused=True)
        self.replay = make_replay(memory_spec(config, observation_space, action_space), config)
        self.rng = np.random.default_rng(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.train_steps = 0

    def policy_weights(self) -> dict[str, torch.Tensor]:
        return cpu_weights(self.actor)

    def load_policy_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.actor.load_state_dict(weights)
        self.target_actor.load_state_dict(weights)

    def update(self, sample: Sample, share: Share | None = None) -> dict[str, float]:
        """A critic step; every `policy_delay` of them an actor step and the targets' Polyak step."""
        batch = TransitionBatch.on(sample if share is None else share.of_sample(sample), self.device)
        batch = replace(batch, actions=self.actor.from_env(batch.actions))  # in the actor's [-1, 1] units
        whole = (len(sample.index), batch.actions.shape[1])  # noise for every row: each rank slices its own
        noise = torch.randn(whole, generator=self.generator).to(self.device)
        noise = noise if share is None else share.of(noise)
        with torch.no_grad():
            targets = critic_targets(self.target_critic, smoothed_target_actions(self.target_actor, batch.next_obs,
                                                                                  noise, self.config), batch)
        loss, errors, q1 = critic_loss(self.critic, batch, targets)
        step_optimizer(self.critic_optimizer, loss, share)
        self.reprioritize(sample, lambda: twin_td_errors(errors), share)
        self.train_steps += 1
        metrics = {"critic_loss": loss.item(), "q_mean": q1.mean().item()}
        if self.train_steps % self.config.policy_delay == 0:
            metrics["actor_loss"] = self._update_actor_and_targets(batch.obs, share)
        return metrics

    def _update_actor_and_targets(self, obs: torch.Tensor, share: Share | None) -> float:
        self.critic.requires_grad_(False)
        loss = actor_loss(self.actor, self.critic, obs)
        step_optimizer(self.actor_optimizer, loss, share)
        self.critic.requires_grad_(True)
        with torch.no_grad():
            for target, online in ((self.target_actor, self.actor), (self.target_critic, self.critic)):
                torch._foreach_lerp_(list(target.parameters()), list(online.parameters()), self.config.tau)
        return loss.item()

PARTS = AlgorithmParts(
    learner=TD3Learner,
    network=make_actor,
    policy=lambda network, config, exploration, seed: TD3Policy(network, config.exploration_noise, seed),
    greedy=lambda actor, config: GreedyActions(actor, lambda obs: actor.to_env(actor(obs)), discrete=False),
)
