"""IMPALA's learner (Espeholt et al. 2018): an actor-critic that learns from each batch of its
workers' steps as it lands, the steps taken by whatever version each worker had; V-trace
(agents/vtrace.py) corrects targets and policy gradient for that lag.

Per batch: the learning policy's log-probabilities and the critic's values of every step, then
V-trace per worker's sequence of steps, then `epochs` passes of minibatch updates of the loss:
-rho A log pi(a|s) + c1 (V(s) - v)^2 - c2 H. APPO (agents/appo.py) is this learner with PPO's
clipped surrogate in place of the plain policy gradient.
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
    PPOPolicy,
    bootstrapped_values,
    continuing,
    explained_variance,
    greedy_actions,
    live_observations,
    make_actor_critic,
)
from gymflow.agents.batches import Rollout
from gymflow.agents.configs import IMPALAConfig, VTraceOptions
from gymflow.agents.core import AlgorithmParts, Learner
from gymflow.agents.data_parallel import minibatch_sizes
from gymflow.agents.graphed import MinibatchUpdate
from gymflow.agents.networks import Adam, cpu_weights, mean_metrics, on_device, seeded_init
from gymflow.agents.normalization import RewardScaler, share_normalizer
from gymflow.agents.training_state import SavedWhole
from gymflow.agents.vtrace import importance_metrics, vtrace_targets

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class IMPALALossTerms:
    """The V-trace actor-critic loss's terms for one minibatch; `loss` is what is minimised."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    value_loss: torch.Tensor
    entropy: torch.Tensor

    @torch.no_grad()
    def metrics(self) -> dict[str, torch.Tensor]:
        """On the device, unread (networks.mean_metrics reads an update's at once)."""
        return {"policy_loss": self.policy_loss.detach(), "value_loss": self.value_loss.detach(),
                "entropy": self.entropy.detach()}


def impala_loss(network: ActorCritic, minibatch: Batch, config: VTraceOptions) -> IMPALALossTerms:
    """Espeholt et al. 2018, section 4.2: the policy gradient -A log pi(a|s), where A is V-trace's
    advantage (already weighted by the truncated importance weight); the critic's squared error
    against the V-trace target; the entropy bonus. Pure: nothing is stepped."""
    dist, value = network.distribution_and_value(minibatch["obs"])
    policy_loss = -(dist.log_prob(minibatch["actions"]) * minibatch["advantages"]).mean()
    value_loss = (value - minibatch["returns"]).pow(2).mean()
    entropy = dist.entropy().mean()
    loss = policy_loss + config.value_coef * value_loss - config.entropy_coef * entropy
    return IMPALALossTerms(loss, policy_loss, value_loss, entropy)


class IMPALALearner(SavedWhole, Learner):
    """Learns from each batch as it lands (distribution.mode async); see the module's docstring."""

    TRAINING_STATE = ("network", "optimizer", "generator", "train_steps", "reward_scaler")

    def __init__(self, config: VTraceOptions, observation_space: spaces.Box, action_space: spaces.Space, seed: int,
                 device: str = "cpu"):
        self.config = config
        self.device = torch.device(device)
        with seeded_init(seed):
            self.network = make_actor_critic(config, observation_space, action_space).to(self.device)
        self.optimizer = Adam(self.network.parameters(), lr=config.lr, eps=1e-5, fused=True)
        self.generator = torch.Generator().manual_seed(seed)
        self.train_steps = 0
        self.normalizer = share_normalizer(self.network)
        self.reward_scaler = RewardScaler(config.gamma, config.reward_clip) if config.normalize_rewards else None
        self.updates = MinibatchUpdate(self.network, self.optimizer, config.max_grad_norm,
                                       graphed=config.cuda_graph)

    def policy_weights(self) -> dict[str, torch.Tensor]:
        return cpu_weights(self.network)

    def load_policy_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.network.load_state_dict(weights)

    def learn(self, rollouts: Sequence[Rollout], progress: float, streams: Sequence[int] | None = None
              ) -> dict[str, float]:
        """Learn from one batch; `streams`: the worker each rollout continues the envs of."""
        if self.reward_scaler is not None:
            self.reward_scaler.update([r.rewards for r in rollouts], [r.terminated | r.truncated for r in rollouts],
                                      streams)
        lr = self.config.lr * (1.0 - progress) if self.config.anneal_lr else self.config.lr
        for group in self.optimizer.param_groups:
            group["lr"] = max(lr, 1e-8)
        batch = self._targets(rollouts)
        rows = [self._update(minibatch) for _ in range(self.config.epochs) for minibatch in self._passes(batch)]
        self.train_steps += len(rows)
        if self.normalizer is not None:  # after the update: the batch's log-probabilities used these statistics
            self.normalizer.observe(live_observations(rollout) for rollout in rollouts)
        learnt = mean_metrics(rows)
        if self.ranks is not None:
            learnt = self.ranks.mean(learnt, self._rank_rows(batch))
        return learnt | importance_metrics(batch["rhos"], self.config.vtrace_rho_bar) | {
            "explained_variance": explained_variance(batch["values"], batch["returns"]),
            "lr": lr, "train_steps": float(self.train_steps)}

    @torch.no_grad()
    def _targets(self, rollouts: Sequence[Rollout]) -> Batch:
        """The batch's samples, flat: what acted, how likely the acting policy and the learning
        one (as the batch lands: the proximal policy) find it, and the V-trace targets of each
        rollout's sequence."""
        config, device = self.config, self.device
        parts: dict[str, list[torch.Tensor]] = {}
        for rollout in rollouts:
            steps, n = rollout.rewards.shape
            obs = on_device(rollout.obs, device).flatten(0, 1)
            actions = on_device(rollout.actions, device).flatten(0, 1)
            actions = actions if self.network.discrete else actions.float()
            dist, values = self.network.distribution_and_value(obs)
            values, next_values = bootstrapped_values(self.network, rollout, device, values.view(steps, n))
            behaviour = on_device(rollout.log_probs, device)
            rewards = rollout.rewards if self.reward_scaler is None else self.reward_scaler.scale(rollout.rewards)
            learning = dist.log_prob(actions).view(steps, n)
            log_rhos, live = learning - behaviour, None
            if rollout.alive is not None:  # a row the policy did not act in is the env's own step: weight 1
                live = on_device(rollout.alive, device)
                log_rhos = torch.where(live, log_rhos, torch.zeros_like(log_rhos))
            targets = vtrace_targets(log_rhos, on_device(rewards, device), values, next_values,
                                     continuing(rollout, device), config)
            samples = {"obs": obs, "actions": actions, "log_probs": behaviour.flatten(),
                       "proximal_log_probs": learning.flatten(),
                       "advantages": targets.advantages.flatten(), "returns": targets.values.flatten(),
                       "values": values.flatten(), "rhos": targets.rhos.flatten()}
            for key, value in samples.items():  # rows the policy did not act in are no samples
                parts.setdefault(key, []).append(value if live is None else value[live.flatten()])
        return {key: torch.cat(value) for key, value in parts.items()}

    def _passes(self, batch: Batch) -> Iterator[Batch]:
        """One epoch's minibatches: the samples shuffled, minibatch_size at a time (None: all)."""
        size = len(batch["obs"])
        order = torch.randperm(size, generator=self.generator).to(self.device)
        step = self.config.minibatch_size or size
        for start in range(0, size, step):
            index = order[start : start + step]
            yield {key: value[index] for key, value in batch.items()}

    def _rank_rows(self, batch: Batch) -> int:
        """This rank's rows over a call's epochs (what its metrics are weighted by among the ranks)."""
        assert self.ranks is not None
        size = len(batch["obs"])
        return self.config.epochs * self.ranks.rows_in(minibatch_sizes(size, self.config.minibatch_size or size))

    def _update(self, minibatch: Batch) -> dict[str, torch.Tensor]:
        return self.updates.step(self._loss, minibatch, {}, self.ranks)

    def _loss(self, minibatch: Batch, scalars: dict[str, float | torch.Tensor]
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        terms = impala_loss(self.network, minibatch, self.config)
        return terms.loss, terms.metrics()


def make_network(config: IMPALAConfig, observation_space: spaces.Box, action_space: spaces.Space) -> nn.Module:
    return make_actor_critic(config, observation_space, action_space)


def make_policy(network: nn.Module, config: Any, exploration: float, seed: int) -> PPOPolicy:
    return PPOPolicy(network, seed)


PARTS = AlgorithmParts(learner=IMPALALearner, network=make_network, policy=make_policy, greedy=greedy_actions)
