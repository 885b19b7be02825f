"""Asynchronous PPO (APPO, as RLlib builds it): IMPALA's learner (agents/impala.py) with PPO's
clipped surrogate objective on V-trace's advantages.

The surrogate's ratio is taken against the proximal policy, the learner's as the batch lands,
not against the version that acted (Hilton et al. 2021, "decoupled" PPO; RLlib's APPO clips
against its target network): the trust region is where the learner stands, and the lag between
the acting version and the learner is V-trace's to correct (its advantages carry the truncated
importance weight pi_proximal / mu). Clipped against the acting version instead (Sample
Factory's choice), a batch one version behind starts with its ratios away from 1 and much of it
clipped out of the gradient; CartPole needed ~2.5x the env steps that way (docs/benchmarks.md).
With no lag the two are the same: the proximal policy is the acting one.
"""

from __future__ import annotations

import torch

from gymflow.agents.actor_critic import ActorCritic, greedy_actions
from gymflow.agents.configs import APPOConfig
from gymflow.agents.core import AlgorithmParts
from gymflow.agents.impala import Batch, IMPALALearner, make_network, make_policy
from gymflow.agents.ppo_learner import PPOLossTerms, ppo_loss, whole_minibatch_advantages


class APPOLearner(IMPALALearner):
    """IMPALA's learning from landed batches, with the clipped surrogate (`ppo_loss` on V-trace's
    advantages and value targets, its ratio against the proximal policy)."""

    def _update(self, minibatch: Batch) -> dict[str, torch.Tensor]:
        if self.ranks is not None:  # over the whole minibatch, before the ranks share its rows out
            minibatch = whole_minibatch_advantages(minibatch, self.config.normalize_advantages)
        return super()._update(minibatch)

    def _loss(self, minibatch: Batch, scalars: dict[str, float | torch.Tensor]
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return appo_loss(self.network, minibatch, self.config, normalized=self.ranks is not None)


def appo_loss(network: ActorCritic, minibatch: Batch, config: APPOConfig, normalized: bool = False
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate, value error and entropy (`ppo_loss`) with the ratio
    pi(a|s) / pi_proximal(a|s) and V-trace's advantages and targets (`normalized`: already
    over the whole minibatch). Pure: nothing is stepped."""
    terms: PPOLossTerms = ppo_loss(network, {**minibatch, "log_probs": minibatch["proximal_log_probs"]}, config,
                                   normalized=normalized)
    return terms.loss, terms.metrics(config.clip_range)


PARTS = AlgorithmParts(learner=APPOLearner, network=make_network, policy=make_policy, greedy=greedy_actions)
