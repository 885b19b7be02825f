"""Asynchronous PPO (APPO, as Sample Factory and RLlib build it): IMPALA's learner
(agents/impala.py) with PPO's clipped surrogate objective on V-trace's advantages.

The ratio in the surrogate is the learning policy's probability over the acting version's (the
behaviour policy, however many versions behind), so a lagging batch's steps are clipped as PPO
clips a late epoch's; V-trace's targets and advantages have already corrected for the lag.
"""

from __future__ import annotations

import torch

from gymflow.agents.core import AlgorithmParts
from gymflow.agents.impala import Batch, IMPALALearner, make_network, make_policy
from gymflow.agents.ppo import PPOLossTerms, ppo_loss


class APPOLearner(IMPALALearner):
    """IMPALA's learning from landed batches, with the clipped surrogate (`ppo_loss` on V-trace's
    advantages and value targets)."""

    def _loss(self, minibatch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        terms: PPOLossTerms = ppo_loss(self.network, minibatch, self.config)
        return terms.loss, terms.metrics(self.config.clip_range)


PARTS = AlgorithmParts(learner=APPOLearner, network=make_network, policy=make_policy)
