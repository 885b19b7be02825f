"""Off-policy evaluation: what a target policy would score, estimated from decisions another policy
(the behaviour, a deployed one) took and logged with their probabilities. Plain numpy; no env.

One-step decisions (a contextual bandit: each decision its own episode), as Coach's
`rl_coach/off_policy_evaluators/bandits` and Open Bandit Pipeline compute them, with importance
weights w = pi(a|x) / mu(a|x) of the logged action a:

- IPS (inverse propensity scoring): mean(w r)
- SNIPS (self-normalised IPS): sum(w r) / sum(w)
- DM (the direct method): mean(sum_a pi(a|x) q(x, a)), with q a reward model
- DR (doubly robust, Dudik et al. 2011): DM + mean(w (r - q(x, a)))

Episodes (Precup et al. 2000; Jiang & Li 2016; Thomas & Brunskill 2016), with the cumulative weight
rho_t = prod_{k<=t} w_k of each episode's first t + 1 decisions:

- PDIS (per-decision importance sampling): mean over episodes of sum_t gamma^t rho_t r_t
- WPDIS (weighted PDIS): sum_t gamma^t sum_i rho_t^i r_t^i / sum_i rho_t^i
- DR (doubly robust for sequences): mean of sum_t gamma^t (rho_t (r_t - q_t) + rho_{t-1} v_t), where
  q_t = Q(s_t, a_t) and v_t = sum_a pi(a|s_t) Q(s_t, a) of a learned Q of the target policy
- WDR (weighted DR): DR with each rho_t normalised over the episodes, as WPDIS does

Each estimate comes with a 95% interval of the bootstrap (resampling decisions or episodes, seeded:
the same logs give the same interval) and the effective sample size (sum w)^2 / sum w^2 of the
weights (an episode's: its last cumulative weight). A target that puts probability on actions the
behaviour could not take (probability 0 under it) has no support in the logs: refused (`NoSupport`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

BOOTSTRAP_RESAMPLES = 2_000
CONFIDENCE = 0.95


class NoSupport(ValueError):
    """The target acts where the logs have no support; one line saying how many decisions lack it."""


class Estimate(NamedTuple):
    value: float
    low: float  # the bootstrap interval's ends
    high: float
    effective_sample_size: float


class Decisions(NamedTuple):
    """N logged one-step decisions, and what the target policy and a reward model say of them."""

    actions: np.ndarray  # [N] int: the action the behaviour took
    rewards: np.ndarray  # [N]
    logged_probs: np.ndarray  # [N] mu(a|x): the behaviour's probability of the action it took
    target_probs: np.ndarray  # [N, A] pi(.|x): the target's probability of each action
    rewards_model: np.ndarray | None = None  # [N, A] q(x, .): a reward model's estimate of each action's reward
    behaviour_probs: np.ndarray | None = None  # [N, A] mu(.|x) where the logs hold the whole distribution


class Episodes(NamedTuple):
    """E logged episodes, padded to T decisions ([E, T] arrays; `mask` marks the real ones), and what the
    target policy and a learned Q of it say of them."""

    rewards: np.ndarray  # [E, T]
    logged_probs: np.ndarray  # [E, T] mu(a_t|s_t) of the action taken (1 where padded)
    target_probs: np.ndarray  # [E, T] pi(a_t|s_t) of that action (1 where padded)
    mask: np.ndarray  # [E, T] bool: a decision, not padding
    q_values: np.ndarray | None = None  # [E, T] Q(s_t, a_t) of the target policy
    state_values: np.ndarray | None = None  # [E, T] sum_a pi(a|s_t) Q(s_t, a)


def evaluate_decisions(decisions: Decisions, seed: int = 0) -> dict[str, Estimate]:
    """Every one-step estimator the logs allow (DM and DR need a reward model)."""
    checked_support(decisions)
    weights = importance_weights(decisions)
    weighted = weights * decisions.rewards
    estimators: dict[str, Callable[[np.ndarray], float]] = {
        "ips": lambda rows: float(np.mean(weighted[rows])),
        "snips": lambda rows: float(np.sum(weighted[rows]) / max(np.sum(weights[rows]), 1e-12)),
    }
    if decisions.rewards_model is not None:
        modelled = np.sum(decisions.target_probs * decisions.rewards_model, axis=1)
        terms = doubly_robust_terms(decisions)
        estimators["dm"] = lambda rows: float(np.mean(modelled[rows]))
        estimators["dr"] = lambda rows: float(np.mean(terms[rows]))
    ess = effective_sample_size(weights)
    return {name: bootstrapped(estimator, len(weights), ess, seed) for name, estimator in estimators.items()}


def doubly_robust_terms(decisions: Decisions) -> np.ndarray:
    """[N] each decision's term of DR, whose mean is the estimate: the reward model's value of the
    target's choice, corrected by the weighted error of its reward for the logged action."""
    assert decisions.rewards_model is not None, "doubly robust needs a reward model"
    modelled = np.sum(decisions.target_probs * decisions.rewards_model, axis=1)
    taken = decisions.rewards_model[np.arange(len(decisions.actions)), decisions.actions]
    return modelled + importance_weights(decisions) * (decisions.rewards - taken)


def evaluate_episodes(episodes: Episodes, gamma: float, seed: int = 0) -> dict[str, Estimate]:
    """Every episodic estimator the logs allow (DR and WDR need the target's learned Q)."""
    if np.any(episodes.mask & (episodes.logged_probs <= 0)):
        raise NoSupport(f"{int(np.sum(episodes.mask & (episodes.logged_probs <= 0))):,} logged decisions have "
                        "probability 0 under the policy that took them: the logs are not a policy's")
    rho = cumulative_weights(episodes)
    discounts = gamma ** np.arange(episodes.rewards.shape[1])
    rewards = np.where(episodes.mask, episodes.rewards, 0.0)
    estimators: dict[str, Callable[[np.ndarray], float]] = {
        "pdis": lambda rows: float(np.mean(np.sum(discounts * rho[rows] * rewards[rows], axis=1))),
        "wpdis": lambda rows: float(np.sum(discounts * _normalised(rho[rows], episodes.mask[rows]) * rewards[rows])),
    }
    if episodes.q_values is not None and episodes.state_values is not None:
        before = np.concatenate([np.ones((len(rho), 1)), rho[:, :-1]], axis=1)  # rho_{t-1}; 1 before the first
        q = np.where(episodes.mask, episodes.q_values, 0.0)
        v = np.where(episodes.mask, episodes.state_values, 0.0)
        estimators["dr"] = lambda rows: float(np.mean(np.sum(
            discounts * (rho[rows] * (rewards[rows] - q[rows]) + before[rows] * v[rows]), axis=1)))
        estimators["wdr"] = lambda rows: _weighted_dr(rows, rho, before, (rewards, q, v), episodes.mask, discounts)
    last = rho[np.arange(len(rho)), np.maximum(episodes.mask.sum(axis=1) - 1, 0)]
    ess = effective_sample_size(last)
    return {name: bootstrapped(estimator, len(rho), ess, seed) for name, estimator in estimators.items()}


def checked_support(decisions: Decisions) -> None:
    """NoSupport where a logged probability is 0, or (the behaviour's whole distribution logged) where
    the target gives probability to an action the behaviour could not take."""
    lacking = decisions.logged_probs <= 0
    if decisions.behaviour_probs is not None:
        lacking |= np.any((decisions.behaviour_probs <= 0) & (decisions.target_probs > 0), axis=1)
    if lacking.any():
        raise NoSupport(f"the target policy acts where the logs have no support: {int(lacking.sum()):,} of "
                        f"{len(lacking):,} decisions give probability 0 to an action it may take")


def importance_weights(decisions: Decisions) -> np.ndarray:
    """pi(a|x) / mu(a|x) of each logged action."""
    target = decisions.target_probs[np.arange(len(decisions.actions)), decisions.actions]
    return target / decisions.logged_probs


def cumulative_weights(episodes: Episodes) -> np.ndarray:
    """[E, T] rho_t: the product of each episode's weights up to decision t (held past its end)."""
    steps = np.where(episodes.mask, episodes.target_probs / episodes.logged_probs, 1.0)
    return np.cumprod(steps, axis=1)


def effective_sample_size(weights: np.ndarray) -> float:
    """(sum w)^2 / sum w^2: how many equally weighted samples the weights are worth."""
    squares = float(np.sum(np.square(weights)))
    return float(np.sum(weights)) ** 2 / squares if squares > 0 else 0.0


def _normalised(rho: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """rho_t over its sum at each decision t over every episode, one that has ended holding its last
    weight (its rewards past its end are 0): an episode that ended early still counts, as 0 reward,
    so on-policy logs give their mean return. Zero where the decision is padding or no episode has
    weight."""
    totals = rho.sum(axis=0, keepdims=True)
    weights = np.divide(rho, totals, out=np.zeros_like(rho), where=totals > 0)
    return np.where(mask, weights, 0.0)


def _weighted_dr(rows: np.ndarray, rho: np.ndarray, before: np.ndarray, values: tuple[np.ndarray, ...],
                 mask: np.ndarray, discounts: np.ndarray) -> float:
    """WDR over the episodes `rows`: DR's terms with rho_t and rho_{t-1} normalised over the episodes."""
    rewards, q, v = (part[rows] for part in values)
    now = _normalised(rho[rows], mask[rows])
    earlier = _normalised(before[rows], np.concatenate([np.ones((len(rows), 1), bool), mask[rows][:, :-1]], axis=1))
    return float(np.sum(discounts * (now * (rewards - q) + earlier * v)))


def bootstrapped(estimator: Callable[[np.ndarray], float], count: int, ess: float, seed: int) -> Estimate:
    """The estimate on every row (decision, episode), and its bootstrap percentile interval over
    resampled rows (seeded)."""
    rng = np.random.default_rng(seed)
    resampled = [estimator(rng.integers(0, count, count)) for _ in range(BOOTSTRAP_RESAMPLES)]
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(resampled, [tail, 100 - tail])
    return Estimate(estimator(np.arange(count)), float(low), float(high), ess)
