"""Proximal Policy Optimization's learning: clipped surrogate objective, GAE, value bootstrap on truncation.

Schulman et al. 2017. The learner reads like the paper: compute advantages with the current
critic, then a few epochs of minibatch updates of the clipped objective.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from gymnasium import spaces
from torch import nn

from gymflow.agents.actor_critic import (
    ActorCritic,
    bootstrapped_values,
    continuing,
    explained_variance,
    live_observations,
    make_actor_critic,
)
from gymflow.agents.batches import Rollout
from gymflow.agents.configs import PPOConfig
from gymflow.agents.core import Learner
from gymflow.agents.data_parallel import minibatch_sizes, normalized_advantages
from gymflow.agents.graphed import MinibatchUpdate
from gymflow.agents.networks import Adam, cpu_weights, mean_metrics, on_device, seeded_init
from gymflow.agents.normalization import RewardScaler, share_normalizer
from gymflow.agents.policy_groups import PolicyGroups
from gymflow.agents.training_state import SavedWhole


def make_network(config: PPOConfig, observation_space: spaces.Box, action_space: spaces.Space) -> nn.Module:
    """One ActorCritic, or one per policy where a PettingZoo env's agent groups act with several
    (agent.policies; agents/policy_groups.py)."""
    policies = config.policy_of_each(getattr(observation_space, "groups", ()))
    if len(set(policies)) < 2:
        return make_actor_critic(config, observation_space, action_space)
    names = list(dict.fromkeys(policies))
    networks = {name: make_actor_critic(config, observation_space, action_space) for name in names}
    return PolicyGroups(networks, [names.index(name) for name in policies], observation_space.index_at)


@dataclass(frozen=True)
class PPOLossTerms:
    """The clipped surrogate objective's terms for one minibatch; `loss` is what is minimised."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    value_loss: torch.Tensor
    entropy: torch.Tensor
    log_ratio: torch.Tensor  # [B] log pi_new(a|s) - log pi_acting(a|s)

    @torch.no_grad()
    def metrics(self, clip_range: float | torch.Tensor) -> dict[str, torch.Tensor]:
        """On the device, unread (networks.mean_metrics reads an update's at once)."""
        ratio = self.log_ratio.exp()
        return {
            "policy_loss": self.policy_loss.detach(),
            "value_loss": self.value_loss.detach(),
            "entropy": self.entropy.detach(),
            "approx_kl": ((ratio - 1) - self.log_ratio).mean(),  # Schulman's unbiased estimator
            "clip_fraction": ((ratio - 1).abs() > clip_range).float().mean(),
        }


def ppo_loss(network: ActorCritic, minibatch: dict[str, torch.Tensor], config: PPOConfig,
             clip_range: float | torch.Tensor | None = None, normalized: bool = False) -> PPOLossTerms:
    """Schulman et al. 2017, eq. 7 and 9: -min(r A, clip(r, 1-eps, 1+eps) A) + c1 (V - R)^2 - c2 H,
    with advantages normalised per minibatch (`normalized`: they already are); eps is `clip_range`
    (None: the config's). Pure: nothing is stepped."""
    dist, value = network.distribution_and_value(minibatch["obs"])
    return clipped_objective(dist, value, minibatch, config, clip_range, normalized)


def clipped_objective(dist: torch.distributions.Distribution, value: torch.Tensor, minibatch: dict[str, torch.Tensor],
                      config: PPOConfig, clip_range: float | torch.Tensor | None = None, normalized: bool = False
                      ) -> PPOLossTerms:
    """PPO's loss for a minibatch whose policy distribution and values the network has given."""
    epsilon = config.clip_range if clip_range is None else clip_range
    log_ratio = dist.log_prob(minibatch["actions"]) - minibatch["log_probs"]
    ratio = log_ratio.exp()
    advantages = minibatch["advantages"]
    if config.normalize_advantages and len(advantages) > 1 and not normalized:
        advantages = normalized_advantages(advantages)
    clipped = ratio.clamp(1 - epsilon, 1 + epsilon)
    policy_loss = -torch.min(advantages * ratio, advantages * clipped).mean()
    value_loss = (value - minibatch["returns"]).pow(2).mean()
    entropy = dist.entropy().mean()
    loss = policy_loss + config.value_coef * value_loss - config.entropy_coef * entropy
    return PPOLossTerms(loss, policy_loss, value_loss, entropy, log_ratio)


class PPOLearner(SavedWhole, Learner):
    """PPO's learner for feed-forward networks (agents/recurrent.py's learns LSTM policies by sequence)."""

    TRAINING_STATE = ("network", "optimizer", "generator", "train_steps", "reward_scaler")

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
        self.updates = MinibatchUpdate(self.network, self.optimizer, config.max_grad_norm,
                                       graphed=self._graphable(config))

    def _make_network(self, config: PPOConfig, observation_space: spaces.Box, action_space: spaces.Space
                      ) -> nn.Module:
        return make_network(config, observation_space, action_space)

    def policy_weights(self) -> dict[str, torch.Tensor]:
        return cpu_weights(self.network)

    def load_policy_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.network.load_state_dict(weights)

    def learn(self, rollouts: Sequence[Rollout], progress: float, streams: Sequence[int] | None = None
              ) -> dict[str, float]:
        if self.reward_scaler is not None:  # each rollout continues the envs of its worker's last one
            self.reward_scaler.update([r.rewards for r in rollouts], [r.terminated | r.truncated for r in rollouts],
                                      streams)
        batch, flat = self._minibatches(rollouts)
        lr = self.config.lr * (1.0 - progress) if self.config.anneal_lr else self.config.lr
        for group in self.optimizer.param_groups:
            group["lr"] = max(lr, 1e-8)
        if self.config.anneal_clip_range:
            self.clip_range = max(self.config.clip_range * (1.0 - progress), 1e-8)
        rows = []
        for epoch in range(self.config.epochs):
            if epoch > 0 and self.config.recompute_advantages:
                batch, _ = self._minibatches(rollouts)  # the explained variance stays the first critic's
            rows += [self._update(minibatch) for minibatch in self._passes(batch)]
        self.train_steps += len(rows)
        # Only now do the observation statistics move: the rollouts' log-probabilities and values
        # were computed with the statistics that acted, and so are this batch's (the ratio starts at 1)
        if self.normalizer is not None:
            self.normalizer.observe(live_observations(rollout) for rollout in rollouts)
        metrics = mean_metrics(rows) if self.ranks is None else self.ranks.mean(
            mean_metrics(rows), self.config.epochs * self.ranks.rows_in(minibatch_sizes(len(batch["obs"]),
                                                                                         self.config.minibatch_size)))
        metrics["explained_variance"] = explained_variance(flat["values"], flat["returns"])
        metrics["lr"] = lr
        metrics["clip_range"] = self.clip_range
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

    def _graphable(self, config: PPOConfig) -> bool:
        """Whether the minibatch update may be replayed as a CUDA graph (agent.cuda_graph; on a GPU only)."""
        return config.cuda_graph

    def _loss(self, minibatch: dict[str, torch.Tensor], clip_range: float | torch.Tensor) -> PPOLossTerms:
        return ppo_loss(self.network, minibatch, self.config, clip_range, normalized=self.ranks is not None)

    def _update(self, minibatch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.ranks is not None:  # over the whole minibatch, before the ranks share its rows out
            minibatch = whole_minibatch_advantages(minibatch, self.config.normalize_advantages)
        return self.updates.step(self._loss_and_metrics, minibatch, {"clip_range": self.clip_range}, self.ranks)

    def _loss_and_metrics(self, minibatch: dict[str, torch.Tensor], scalars: dict[str, float | torch.Tensor]
                          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        terms = self._loss(minibatch, scalars["clip_range"])
        return terms.loss, terms.metrics(scalars["clip_range"])

    @torch.no_grad()
    def _flatten(self, rollouts: Sequence[Rollout]) -> dict[str, torch.Tensor]:
        """The iteration's samples, flat: what acted, and the advantages and returns the critic
        gives them now."""
        names = ("obs", "actions", "log_probs", "advantages", "returns", "values")
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in names}
        for rollout in rollouts:
            values, next_values = self._critic_values(rollout)
            scaled = rollout.rewards if self.reward_scaler is None else self.reward_scaler.scale(rollout.rewards)
            continues = continuing(rollout, self.device)
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
        return bootstrapped_values(self.network, rollout, self.device)


def whole_minibatch_advantages(minibatch: dict[str, torch.Tensor], normalize: bool) -> dict[str, torch.Tensor]:
    """The minibatch with its advantages normalised over all its rows (where `normalize` and it has
    more than one), as the loss of one rank's share of them would not."""
    if not normalize or len(minibatch["advantages"]) < 2:
        return minibatch
    return {**minibatch, "advantages": normalized_advantages(minibatch["advantages"])}


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
