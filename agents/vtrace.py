"""V-trace (Espeholt et al. 2018, section 4.1): value targets and policy-gradient advantages for
an actor-critic that learns from steps its workers took with older versions of its policy.

Over [T, N] steps of N envs, with importance weights rho_t = pi(a_t|s_t) / mu(a_t|s_t) of the
learning policy pi against the acting one mu:

    delta_t   = min(rho_bar, rho_t) (r_t + gamma V'_t - V(s_t))
    v_t - V(s_t) = delta_t + gamma c_t k_t (v_t+1 - V(s_t+1)),   c_t = lambda min(c_bar, rho_t)
    A_t       = min(rho_bar, rho_t) (r_t + gamma (V'_t + k_t (v_t+1 - V(s_t+1))) - V(s_t))

where V'_t is the value step t bootstraps from (V(s_t+1); the final observation's value where an
episode was truncated; 0 after a terminal step) and k_t is 0 where an episode ended at step t, so
nothing leaks from one episode into the next. v_T - V(s_T) = 0 past the rollout's last step.
When pi and mu agree and c_bar >= 1 and lambda = 1, v_t is the n-step return to the rollout's end.
Pure: no network, no optimiser.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from gymflow.agents.configs import VTraceOptions


class VTraceTargets(NamedTuple):
    values: torch.Tensor  # [T, N] v_t: what the critic regresses on
    advantages: torch.Tensor  # [T, N] A_t: what weighs the policy gradient
    rhos: torch.Tensor  # [T, N] the importance weights, untruncated


def vtrace_targets(log_rhos: torch.Tensor, rewards: torch.Tensor, values: torch.Tensor, next_values: torch.Tensor,
                   continues: torch.Tensor, config: VTraceOptions) -> VTraceTargets:
    """V-trace over [T, N] steps (module docstring); `log_rhos` = log pi(a|s) - log mu(a|s); gamma,
    rho-bar, c-bar and lambda are the config's."""
    gamma, rhos = config.gamma, log_rhos.exp()
    clipped_rhos = rhos.clamp(max=config.vtrace_rho_bar)
    traces = config.vtrace_lambda * rhos.clamp(max=config.vtrace_c_bar)
    deltas = clipped_rhos * (rewards + gamma * next_values - values)
    corrections = torch.zeros_like(values)  # v_t - V(s_t)
    running = torch.zeros(values.shape[1], dtype=values.dtype, device=values.device)
    for t in reversed(range(len(values))):
        running = deltas[t] + gamma * traces[t] * continues[t] * running
        corrections[t] = running
    following = torch.cat([corrections[1:], torch.zeros_like(corrections[:1])])  # v_t+1 - V(s_t+1)
    bootstrap = next_values + continues * following  # v_t+1 within an episode, V'_t where it ended
    advantages = clipped_rhos * (rewards + gamma * bootstrap - values)
    return VTraceTargets(values + corrections, advantages, rhos)


def importance_metrics(rhos: torch.Tensor, rho_bar: float) -> dict[str, float]:
    """How far the acting policies were from the learning one: the weights' mean and max, and the
    share truncated at rho-bar."""
    return {"importance_weight_mean": rhos.mean().item(), "importance_weight_max": rhos.max().item(),
            "importance_truncated_share": (rhos > rho_bar).float().mean().item()}
