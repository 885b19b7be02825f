"""Proximal Policy Optimization: clipped surrogate objective, GAE, value bootstrap on truncation.

Schulman et al. 2017. The learner reads like the paper: compute advantages with the current
critic, then a few epochs of minibatch updates of the clipped objective.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from torch import nn

from gymflow.agents.batches import Rollout
from gymflow.agents.configs import PPOConfig
from gymflow.agents.core import AlgorithmParts, Learner
from gymflow.agents.networks import (
    Adam,
    cpu_weights,
    hidden_layers,
    mlp,
    observation_reader,
    on_device,
    orthogonal_init,
    seeded_init,
)
from gymflow.agents.normalization import RewardScaler, share_normalizer
from gymflow.agents.policy_groups import PolicyGroups
from gymflow.agents.training_state import SavedWhole
from gymflow.envs.agents import actor_entries
from gymflow.envs.make import reads_pixels

ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU}


class ActorCritic(nn.Module):
    """An actor and a critic head; categorical actions for Discrete, Gaussian for Box. Both read
    the observations through `obs_norm`: for vectors the identity unless normalising, and each
    head is an MLP of `hidden_sizes`; for images the CNN and the hidden layers, which the heads
    share, each head then one linear layer."""

    def __init__(self, obs_dim: int, action_space: spaces.Space, config: PPOConfig, obs_norm: nn.Module,
                 head_hidden_sizes: Sequence[int], actor_inputs: int | None = None):
        super().__init__()
        self.obs_norm = obs_norm
        self.discrete = isinstance(action_space, spaces.Discrete)
        action_dim = int(action_space.n) if self.discrete else int(np.prod(action_space.shape))
        activation = ACTIVATIONS[config.activation]
        # a centralised critic (MAPPO) reads the whole row; the actor its first `actor_inputs` entries alone
        self.actor_inputs = obs_dim if actor_inputs is None else actor_inputs
        self.actor = mlp(self.actor_inputs, head_hidden_sizes, action_dim, activation)
        self.critic = mlp(obs_dim, head_hidden_sizes, 1, activation)
        self.log_std = nn.Parameter(torch.full((0 if self.discrete else action_dim,), config.log_std_init))

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(self.obs_norm(obs)).squeeze(-1)

    def action_output(self, obs: torch.Tensor) -> torch.Tensor:
        """Logits (Discrete) or the Gaussian's mean (Box)."""
        return self.actor(self._actors_part(self.obs_norm(obs)))

    def distribution_and_value(self, obs: torch.Tensor) -> tuple[torch.distributions.Distribution, torch.Tensor]:
        """Both heads over one read of the observations (for images, one pass of the CNN)."""
        features = self.obs_norm(obs)
        return self._distribution(self.actor(self._actors_part(features))), self.critic(features).squeeze(-1)

    def log_std_for(self, obs: torch.Tensor) -> torch.Tensor:
        """The Gaussian's log standard deviation (Box actions), the same for every observation."""
        return self.log_std

    def _actors_part(self, features: torch.Tensor) -> torch.Tensor:
        return features if self.actor_inputs == features.shape[-1] else features[..., : self.actor_inputs]

    def _distribution(self, out: torch.Tensor) -> torch.distributions.Distribution:
        if self.discrete:
            return torch.distributions.Categorical(logits=out)
        return torch.distributions.Independent(torch.distributions.Normal(out, self.log_std.exp()), 1)


class PPOPolicy:
    """Acts with an ActorCritic's actor; samples with its own numpy RNG so rollouts replay."""

    def __init__(self, network: ActorCritic, seed: int):
        self.network = network
        self.rng = np.random.default_rng(seed)

    def act(self, obs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        return self.act_on(obs, self.outputs(obs), explore)

    @torch.inference_mode()
    def outputs(self, obs: np.ndarray) -> np.ndarray:
        """The actor's logits (Discrete) or Gaussian mean (Box), float64."""
        return self.network.action_output(torch.from_numpy(obs)).numpy().astype(np.float64)

    def act_on(self, obs: np.ndarray, out: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        log_std = None if self.network.discrete else self._log_std(obs)
        return sample_actions(out, log_std, self.network.discrete, self.rng, explore)

    @torch.inference_mode()
    def _log_std(self, obs: np.ndarray) -> np.ndarray:
        return self.network.log_std_for(torch.from_numpy(obs)).detach().numpy()


def sample_actions(out: np.ndarray, log_std: np.ndarray | None, discrete: bool, rng: np.random.Generator, explore: bool
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Actions and their log-probabilities from the actor's output (float64 logits, or the
    Gaussian's mean with `log_std`, [action_dim] or one per row): sampled when exploring, else the
    most likely."""
    if discrete:
        log_p = out - out.max(axis=1, keepdims=True)
        log_p -= np.log(np.exp(log_p).sum(axis=1, keepdims=True))
        if explore:  # Gumbel-max: a categorical sample without torch's per-call overhead
            actions = np.argmax(log_p - np.log(-np.log(rng.random(log_p.shape))), axis=1)
        else:
            actions = np.argmax(log_p, axis=1)
        return actions, log_p[np.arange(len(out)), actions].astype(np.float32)
    std = np.exp(log_std.astype(np.float64))
    noise = rng.standard_normal(out.shape) if explore else np.zeros_like(out)
    actions = out + std * noise
    log_prob = -0.5 * (noise**2).sum(1) - np.log(std).sum(-1) - 0.5 * out.shape[1] * math.log(2 * math.pi)
    return actions.astype(np.float32), log_prob.astype(np.float32)


def make_network(config: PPOConfig, observation_space: spaces.Box, action_space: spaces.Space) -> nn.Module:
    """One ActorCritic, or one per policy where a PettingZoo env's agent groups act with several
    (agent.policies; agents/policy_groups.py)."""
    policies = config.policy_of_each(getattr(observation_space, "groups", ()))
    if len(set(policies)) < 2:
        return make_actor_critic(config, observation_space, action_space)
    names = list(dict.fromkeys(policies))
    networks = {name: make_actor_critic(config, observation_space, action_space) for name in names}
    return PolicyGroups(networks, [names.index(name) for name in policies], observation_space.index_at)


def make_actor_critic(config: PPOConfig, observation_space: spaces.Box, action_space: spaces.Space) -> ActorCritic:
    """Vectors: an actor and a critic MLP. Images: the Nature network shared up to its last hidden
    layer, then one linear layer per head (SB3's CnnPolicy, CleanRL's ppo_atari). Either way
    orthogonal weights, gain sqrt 2 for hidden layers, 0.01 for the action output (the first
    policy is near uniform, or near a zero mean), 1 for the value (Huang et al. 2022, detail 2)."""
    reader, width = observation_reader(config, observation_space)
    if reads_pixels(observation_space):
        trunk, width = hidden_layers(width, config.hidden_sizes, ACTIVATIONS[config.activation])
        network = ActorCritic(width, action_space, config, nn.Sequential(reader, trunk), ())
    else:
        actor_inputs = actor_entries(observation_space)  # MAPPO: the rows' global state is the critic's alone
        network = ActorCritic(width, action_space, config, reader, config.hidden_sizes, actor_inputs)
    orthogonal_init(network.obs_norm, math.sqrt(2))
    for head, output_gain in ((network.actor, 0.01), (network.critic, 1.0)):
        orthogonal_init(head[:-1], math.sqrt(2))
        orthogonal_init(head[-1], output_gain)
    return network


@dataclass(frozen=True)
class PPOLossTerms:
    """The clipped surrogate objective's terms for one minibatch; `loss` is what is minimised."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    value_loss: torch.Tensor
    entropy: torch.Tensor
    log_ratio: torch.Tensor  # [B] log pi_new(a|s) - log pi_acting(a|s)

    @torch.no_grad()
    def metrics(self, clip_range: float) -> dict[str, float]:
        ratio = self.log_ratio.exp()
        return {
            "policy_loss": self.policy_loss.item(),
            "value_loss": self.value_loss.item(),
            "entropy": self.entropy.item(),
            "approx_kl": ((ratio - 1) - self.log_ratio).mean().item(),  # Schulman's unbiased estimator
            "clip_fraction": ((ratio - 1).abs() > clip_range).float().mean().item(),
        }


def ppo_loss(network: ActorCritic, minibatch: dict[str, torch.Tensor], config: PPOConfig,
             clip_range: float | None = None) -> PPOLossTerms:
    """Schulman et al. 2017, eq. 7 and 9: -min(r A, clip(r, 1-eps, 1+eps) A) + c1 (V - R)^2 - c2 H,
    with advantages normalised per minibatch; eps is `clip_range` (None: the config's). Pure:
    nothing is stepped."""
    dist, value = network.distribution_and_value(minibatch["obs"])
    return clipped_objective(dist, value, minibatch, config, clip_range)


def clipped_objective(dist: torch.distributions.Distribution, value: torch.Tensor, minibatch: dict[str, torch.Tensor],
                      config: PPOConfig, clip_range: float | None = None) -> PPOLossTerms:
    """PPO's loss for a minibatch whose policy distribution and values the network has given."""
    epsilon = config.clip_range if clip_range is None else clip_range
    log_ratio = dist.log_prob(minibatch["actions"]) - minibatch["log_probs"]
    ratio = log_ratio.exp()
    advantages = minibatch["advantages"]
    if config.normalize_advantages and len(advantages) > 1:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    clipped = ratio.clamp(1 - epsilon, 1 + epsilon)
    policy_loss = -torch.min(advantages * ratio, advantages * clipped).mean()
    value_loss = (value - minibatch["returns"]).pow(2).mean()
    entropy = dist.entropy().mean()
    loss = policy_loss + config.value_coef * value_loss - config.entropy_coef * entropy
    return PPOLossTerms(loss, policy_loss, value_loss, entropy, log_ratio)


class PPOLearner(SavedWhole, Learner):
    """PPO's learner; with agent.recurrent, the recurrent one (agents/recurrent.py) is made instead."""

    TRAINING_STATE = ("network", "optimizer", "generator", "train_steps", "reward_scaler")

    def __new__(cls, config: PPOConfig, *args: Any, **kwargs: Any) -> PPOLearner:
        if cls is PPOLearner and config.recurrent is not None:
            from gymflow.agents.recurrent import RecurrentPPOLearner

            return super().__new__(RecurrentPPOLearner)
        return super().__new__(cls)

    def __init__(self, config: PPOConfig, observation_space: spaces.Box, action_space: spaces.Space, seed: int,
                 device: str = "cpu"):
        self.config = config
        self.device = torch.device(device)
        with seeded_init(seed):
            self.network = self._make_network(config, observation_space, action_space).to(self.device)
        self.optimizer = Adam(self.network.parameters(), lr=config.lr, eps=1e-5, fused=True)
        self.generator = torch.Generator().manual_seed(seed)
        self.train_steps = 0
        self.normalizer = share_normalizer(self.network)
        self.reward_scaler = RewardScaler(config.gamma, config.reward_clip) if config.normalize_rewards else None
        self.clip_range = config.clip_range  # this iteration's (agent.anneal_clip_range)

    def _make_network(self, config: PPOConfig, observation_space: spaces.Box, action_space: spaces.Space
                      ) -> nn.Module:
        return make_network(config, observation_space, action_space)

    def policy_weights(self) -> dict[str, torch.Tensor]:
        return cpu_weights(self.network)

    def load_policy_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.network.load_state_dict(weights)

    def learn(self, rollouts: Sequence[Rollout], progress: float) -> dict[str, float]:
        if self.reward_scaler is not None:  # rollout i continues the envs of the last iteration's rollout i
            self.reward_scaler.update([r.rewards for r in rollouts], [r.terminated | r.truncated for r in rollouts])
        batch, flat = self._minibatches(rollouts)
        lr = self.config.lr * (1.0 - progress) if self.config.anneal_lr else self.config.lr
        for group in self.optimizer.param_groups:
            group["lr"] = max(lr, 1e-8)
        if self.config.anneal_clip_range:
            self.clip_range = max(self.config.clip_range * (1.0 - progress), 1e-8)
        sums = {"policy_loss": 0.0, "value_loss": 0.0, "entropy": 0.0, "approx_kl": 0.0, "clip_fraction": 0.0}
        updates = 0
        for _ in range(self.config.epochs):
            for minibatch in self._passes(batch):
                for key, value in self._update(minibatch).items():
                    sums[key] += value
                updates += 1
        self.train_steps += updates
        # Only now do the observation statistics move: the rollouts' log-probabilities and values
        # were computed with the statistics that acted, and so are this batch's (the ratio starts at 1)
        if self.normalizer is not None:
            self.normalizer.observe(live_observations(rollout) for rollout in rollouts)
        metrics = {key: value / updates for key, value in sums.items()}
        metrics["explained_variance"] = _explained_variance(flat["values"], flat["returns"])
        metrics["lr"] = lr
        metrics["train_steps"] = float(self.train_steps)
        return metrics

    def _minibatches(self, rollouts: Sequence[Rollout]) -> tuple[Any, dict[str, torch.Tensor]]:
        """What the epochs draw minibatches from, and the iteration's values and returns, flat."""
        batch = self._flatten(rollouts)
        return batch, batch

    def _passes(self, batch: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        """One epoch's minibatches: the samples shuffled, minibatch_size at a time."""
        size = len(batch["obs"])
        order = torch.randperm(size, generator=self.generator).to(self.device)
        for start in range(0, size, self.config.minibatch_size):
            index = order[start : start + self.config.minibatch_size]
            yield {key: value[index] for key, value in batch.items()}

    def _loss(self, minibatch: dict[str, torch.Tensor]) -> PPOLossTerms:
        return ppo_loss(self.network, minibatch, self.config, self.clip_range)

    def _update(self, minibatch: dict[str, torch.Tensor]) -> dict[str, float]:
        terms = self._loss(minibatch)
        self.optimizer.zero_grad()
        terms.loss.backward()
        nn.utils.clip_grad_norm_(self.network.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        return terms.metrics(self.clip_range)

    @torch.no_grad()
    def _flatten(self, rollouts: Sequence[Rollout]) -> dict[str, torch.Tensor]:
        """The iteration's samples, flat: what acted, and the advantages and returns the critic
        gives them now."""
        names = ("obs", "actions", "log_probs", "advantages", "returns", "values")
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in names}
        for rollout in rollouts:
            values, next_values = self._critic_values(rollout)
            scaled = rollout.rewards if self.reward_scaler is None else self.reward_scaler.scale(rollout.rewards)
            continues = on_device(~(rollout.terminated | rollout.truncated), self.device).float()
            advantages = generalized_advantages(on_device(scaled, self.device), values, next_values, continues,
                                                self.config.gamma, self.config.gae_lambda)
            actions = on_device(rollout.actions, self.device).flatten(0, 1)
            samples = {"obs": on_device(rollout.obs, self.device).flatten(0, 1),
                       "actions": actions if self.network.discrete else actions.float(),
                       "log_probs": on_device(rollout.log_probs, self.device).flatten(),
                       "advantages": advantages.flatten(), "returns": (advantages + values).flatten(),
                       "values": values.flatten()}
            live = slice(None) if rollout.alive is None else on_device(rollout.alive, self.device).flatten()
            for key, value in samples.items():  # the steps of agents that had left their game are not samples
                parts[key].append(value[live])
        return {key: torch.cat(value) for key, value in parts.items()}

    def _critic_values(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, N] V(s_t), and the value each step bootstraps from: V(s_t+1), the final
        observation's value where an episode was truncated, 0 after a terminal step (an episode's
        end, or a lost life that is terminal for learning only)."""
        steps, n = rollout.rewards.shape
        device = self.device
        values = self.network.value(on_device(rollout.obs, device).flatten(0, 1)).view(steps, n)
        next_values = torch.cat([values[1:], self.network.value(on_device(rollout.last_obs, device))[None]]).flatten()
        if len(rollout.done_index):
            next_values[on_device(rollout.done_index, device)] = self.network.value(on_device(rollout.done_obs, device))
        return values, torch.where(on_device(rollout.terminated, device), 0.0, next_values.view(steps, n))

def live_observations(rollout: Rollout) -> np.ndarray:
    """What the rollout's envs observed, but for the rows of agents that had left their game."""
    return rollout.obs if rollout.alive is None else rollout.obs[rollout.alive]


def generalized_advantages(rewards: torch.Tensor, values: torch.Tensor, next_values: torch.Tensor,
                           continues: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """GAE(gamma, lambda) (Schulman et al. 2016, eq. 16), over [T, N] steps:
    A_t = delta_t + gamma lambda c_t A_t+1, delta_t = r_t + gamma V'_t - V_t, where V'_t is the value
    step t bootstraps from and c_t is 0 where an episode ended at step t (nothing leaks into the next)."""
    deltas = rewards + gamma * next_values - values
    advantages = torch.zeros_like(values)
    running = torch.zeros(values.shape[1], device=values.device)
    for t in reversed(range(len(values))):
        running = deltas[t] + gamma * lam * continues[t] * running
        advantages[t] = running
    return advantages


def _network(config: PPOConfig, observation_space: spaces.Box, action_space: spaces.Space) -> nn.Module:
    if config.recurrent is None:
        return make_network(config, observation_space, action_space)
    from gymflow.agents.recurrent import make_recurrent_network

    return make_recurrent_network(config, observation_space, action_space)


def _policy(network: nn.Module, config: PPOConfig, exploration: float, seed: int) -> Any:
    if config.recurrent is None:
        return PPOPolicy(network, seed)
    from gymflow.agents.recurrent import RecurrentPolicy

    return RecurrentPolicy(network, seed)


PARTS = AlgorithmParts(learner=PPOLearner, network=_network, policy=_policy)


def _explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    variance = returns.var().item()
    return float("nan") if variance == 0 else 1.0 - (returns - values).var().item() / variance
