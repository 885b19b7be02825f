"""Soft Actor-Critic for continuous actions (Haarnoja et al. 2018, with a learned temperature).

A tanh-squashed Gaussian actor, twin critics with Polyak-averaged targets, and an entropy
coefficient tuned towards a target entropy of -dim(A). Actions are scaled to the env's bounds
inside the actor (its buffers), so a rollout worker needs the actor's weights alone.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import numpy as np
import torch
from gymnasium import spaces
from torch import nn

from gymflow.agents.batches import Sample
from gymflow.agents.configs import SACConfig
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
from gymflow.agents.training_state import SavedWhole, Settings

LOG_STD_MIN, LOG_STD_MAX = -20.0, 2.0


class SquashedGaussianActor(BoundedActions, nn.Module):
    """obs -> (mean, log_std) of a Gaussian whose samples are squashed by tanh and scaled to the
    action bounds."""

    def __init__(self, inputs: int, hidden: list[int], action_space: spaces.Box, obs_norm: nn.Module):
        super().__init__()
        self.obs_norm = obs_norm
        self.trunk = mlp(inputs, hidden[:-1], hidden[-1], InplaceReLU)
        self.mean = nn.Linear(hidden[-1], int(np.prod(action_space.shape)))
        self.log_std = nn.Linear(hidden[-1], int(np.prod(action_space.shape)))
        self.register_bounds(action_space)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = torch.relu_(self.trunk(self.obs_norm(obs)))  # the trunk ends in a Linear
        return self.mean(features), self.log_std(features).clamp(LOG_STD_MIN, LOG_STD_MAX)

    def sample(self, obs: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(squashed actions in [-1, 1], their log-probabilities), reparameterised by standard
        normal `noise` [B, A] (zeros: the mean's action). Acting and learning both sample here."""
        mean, log_std = self(obs)
        squashed = torch.tanh(torch.addcmul(mean, log_std.exp(), noise))
        # the Gaussian's log-density at the noise but for log_std's part (no gradient: in place)
        standard = noise.pow(2).sum(dim=1).mul_(-0.5).sub_(0.5 * np.log(2 * np.pi) * noise.shape[1])
        return squashed, standard - log_std.sum(dim=1) - torch.log(1 - squashed.pow(2) + 1e-6).sum(dim=1)


def make_actor(config: SACConfig, observation_space: spaces.Box, action_space: spaces.Box) -> SquashedGaussianActor:
    """The actor, with an observation reader of its own (a CNN of its own for images)."""
    reader, width = observation_reader(config, observation_space)
    return SquashedGaussianActor(width, config.hidden_sizes, action_space, reader)


class SACPolicy:
    """Samples the squashed Gaussian when exploring (noise from its own numpy RNG, so rollouts
    replay), its mean otherwise."""

    def __init__(self, actor: SquashedGaussianActor, seed: int):
        self.actor = actor
        self.rng = np.random.default_rng(seed)

    @torch.inference_mode()
    def act(self, obs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        shape = (len(obs), len(self.actor.action_scale))
        noise = self.rng.standard_normal(shape).astype(np.float32) if explore else np.zeros(shape, np.float32)
        squashed, log_prob = self.actor.sample(torch.from_numpy(obs), torch.from_numpy(noise))
        return self.actor.to_env(squashed).numpy().astype(np.float32), log_prob.numpy()


@dataclass(frozen=True)
class CriticTerms:
    loss: torch.Tensor
    errors: torch.Tensor  # [2, B] each critic's Q - y, detached
    q1: torch.Tensor  # [B] detached


def critic_loss(critic: TwinCritic, target_critic: TwinCritic, actor: SquashedGaussianActor, batch: TransitionBatch,
                next_noise: torch.Tensor, entropy_coef: torch.Tensor) -> CriticTerms:
    """Soft Bellman residual of both critics: y = r + gamma^n (min Q'(s', a') - alpha log pi(a'|s')),
    a' ~ pi(.|s') drawn with `next_noise`; batch actions in the actor's [-1, 1] units. Pure."""
    with torch.no_grad():
        next_actions, next_log_prob = actor.sample(batch.next_obs, next_noise)
        next_q = target_critic.both(batch.next_obs, next_actions).amin(0) - entropy_coef * next_log_prob
        targets = batch.rewards + batch.discounts * next_q
    values = critic.both(batch.obs, batch.actions)  # [2, B]
    errors = values - targets
    loss = 0.5 * weighted_mean(errors.pow(2).sum(0), batch.weights)
    return CriticTerms(loss, errors.detach(), values[0].detach())


def actor_loss(actor: SquashedGaussianActor, critic: TwinCritic, obs: torch.Tensor, noise: torch.Tensor,
               entropy_coef: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E[alpha log pi(a|s) - min Q(s, a)] with a ~ pi(.|s) drawn with `noise`, log pi(a|s)). Pure;
    the caller keeps the critic's gradients out."""
    actions, log_prob = actor.sample(obs, noise)
    return (entropy_coef * log_prob - critic.both(obs, actions).amin(0)).mean(), log_prob


def entropy_coef_loss(log_entropy_coef: torch.Tensor, log_prob: torch.Tensor, target_entropy: float) -> torch.Tensor:
    """The temperature's loss: alpha rises while the policy's entropy is below the target."""
    return -(log_entropy_coef * (log_prob.detach() + target_entropy)).mean()


def entropy_coef_gradient(log_prob: torch.Tensor, target_entropy: float) -> torch.Tensor:
    """`entropy_coef_loss`'s gradient in log alpha, written out: -(E[log pi(a|s)] + target). One
    operation where autograd's backward pass over a scalar costs a tenth of a SAC update."""
    return -(log_prob.detach().mean(0, keepdim=True) + target_entropy)


class SACLearner(TwinCriticCheckpoints, SavedWhole, ReplayLearner):
    TRAINING_STATE = ("actor", "critic", "target_critic", "actor_optimizer", "critic_optimizer", "entropy_optimizer",
                      "log_entropy_coef", "rng", "generator", "train_steps")

    def __init__(self, config: SACConfig, observation_space: spaces.Box, action_space: spaces.Box, seed: int,
                 device: str = "cpu"):
        self.config = config
        self.device = torch.device(device)
        with seeded_init(seed):
            self.actor = make_actor(config, observation_space, action_space)
            self.critic = twin_critic(config, config.hidden_sizes, observation_space, action_space)
        self.actor.to(self.device)
        self.critic.to(self.device)
        self.target_critic = copy.deepcopy(self.critic).requires_grad_(False)
        self.normalizer = share_normalizer(self.actor, self.critic, self.target_critic)
        self.log_entropy_coef = torch.zeros(1, device=self.device, requires_grad=config.entropy_coef is None)
        if config.entropy_coef is not None:
            self.log_entropy_coef.data.fill_(float(np.log(config.entropy_coef)))
        default_target = -float(np.prod(action_space.shape))  # -(number of action dimensions)
        self.target_entropy = config.target_entropy if config.target_entropy is not None else default_target
        self.actor_optimizer = Adam(self.actor.parameters(), lr=config.lr, fused=True)
        self.critic_optimizer = Adam(self.critic.parameters(), lr=config.lr, fused=True)
        self.entropy_optimizer = Adam([self.log_entropy_coef], lr=config.lr, fused=True)
        self.replay = make_replay(memory_spec(config, observation_space, action_space), config)
        self.rng = np.random.default_rng(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.train_steps = 0

    def policy_weights(self) -> dict[str, torch.Tensor]:
        return cpu_weights(self.actor)

    def apply_settings(self, settings: Settings) -> None:
        """And a fixed entropy coefficient (agent.entropy_coef) over the copied one; a learned one
        goes on from where it was."""
        super().apply_settings(settings)
        if self.config.entropy_coef is not None:
            self.log_entropy_coef.data.fill_(float(np.log(self.config.entropy_coef)))

    def load_policy_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.actor.load_state_dict(weights)

    def update(self, sample: Sample, share: Share | None = None) -> dict[str, float]:
        """One step each of the critics, the actor and the temperature, then the target critics'
        Polyak step."""
        batch = TransitionBatch.on(sample if share is None else share.of_sample(sample), self.device)
        batch = replace(batch, actions=self.actor.from_env(batch.actions))  # in the actor's [-1, 1] units
        entropy_coef = self.log_entropy_coef.exp().detach()
        whole = (len(sample.index), batch.actions.shape[1])  # noise for every row: each rank slices its own
        next_noise, noise = (self._noise(whole) if share is None else share.of(self._noise(whole)) for _ in range(2))
        critic = critic_loss(self.critic, self.target_critic, self.actor, batch, next_noise, entropy_coef)
        step_optimizer(self.critic_optimizer, critic.loss, share)
        self.reprioritize(sample, lambda: twin_td_errors(critic.errors), share)
        self.critic.requires_grad_(False)
        actor, log_prob = actor_loss(self.actor, self.critic, batch.obs, noise, entropy_coef)
        step_optimizer(self.actor_optimizer, actor, share)
        self.critic.requires_grad_(True)
        if self.config.entropy_coef is None:
            self.log_entropy_coef.grad = entropy_coef_gradient(log_prob, self.target_entropy)
            if share is not None:
                share.average_gradients([self.log_entropy_coef])
            self.entropy_optimizer.step()
        with torch.no_grad():
            torch._foreach_lerp_(list(self.target_critic.parameters()), list(self.critic.parameters()), self.config.tau)
        self.train_steps += 1
        return {"critic_loss": critic.loss.item(), "actor_loss": actor.item(), "entropy_coef": float(entropy_coef),
                "q_mean": critic.q1.mean().item()}

    def _noise(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Standard normal noise from the learner's CPU generator (the same draws on any device)."""
        return torch.randn(shape, generator=self.generator).to(self.device)

PARTS = AlgorithmParts(
    learner=SACLearner,
    network=make_actor,
    policy=lambda network, config, exploration, seed: SACPolicy(network, seed),
    greedy=lambda actor, config: GreedyActions(actor, lambda obs: actor.to_env(torch.tanh(actor(obs)[0])), False),
)
