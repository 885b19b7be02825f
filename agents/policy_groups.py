"""Separate policies for the agent groups of a PettingZoo env (agent.policies): one ActorCritic
per policy, each row acting and valued by the policy its agent's group maps to.

The rows of every group stay one batch for the learner, so one PPO update steps every policy on
its own rows' samples (their parameters are disjoint: Adam's per-parameter steps keep them apart;
the gradient norm is clipped over all of them together). The agents' observation statistics are
shared.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gymflow.agents.networks import action_distribution


class PolicyGroups(nn.Module):
    """ActorCritic's interface over several of them; `policy_of_agent[k]` is the index (in
    `policies`) of agent k's policy, read from each row's one-hot agent index at `index_at`."""

    def __init__(self, policies: dict[str, nn.Module], policy_of_agent: list[int], index_at: int):
        super().__init__()
        self.policies = nn.ModuleDict(policies)
        self.register_buffer("policy_of_agent", torch.tensor(policy_of_agent, dtype=torch.int64))
        self.index_at, self.agents = index_at, len(policy_of_agent)
        self.discrete = next(iter(policies.values())).discrete

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self._gather(obs, lambda network, rows: network.value(rows))

    def action_output(self, obs: torch.Tensor) -> torch.Tensor:
        return self._gather(obs, lambda network, rows: network.action_output(rows))

    def log_std_for(self, obs: torch.Tensor) -> torch.Tensor:
        """Each row's policy's log standard deviation, [N, action_dim] (Box actions)."""
        log_stds = torch.stack([network.log_std for network in self.policies.values()])
        return log_stds[self._row_policy(obs)]

    def distribution_and_value(self, obs: torch.Tensor) -> tuple[torch.distributions.Distribution, torch.Tensor]:
        out = self.action_output(obs)
        value = self.value(obs)
        if self.discrete:
            return action_distribution(out, None), value
        return action_distribution(out, self.log_std_for(obs).exp()), value

    def _row_policy(self, obs: torch.Tensor) -> torch.Tensor:
        agent = obs[:, self.index_at : self.index_at + self.agents].argmax(1)
        return self.policy_of_agent[agent]

    def _gather(self, obs: torch.Tensor, head: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`head(network, its rows)` of each policy, put back in the rows' order."""
        row_policy = self._row_policy(obs)
        outputs, where = [], []
        for index, network in enumerate(self.policies.values()):
            rows = (row_policy == index).nonzero().squeeze(1)
            outputs.append(head(network, obs[rows]))
            where.append(rows)
        order = torch.argsort(torch.cat(where))
        return torch.cat(outputs)[order]
