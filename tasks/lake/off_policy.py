"""Policies scored on what a deployed policy did, with no env played: a decision log's held-out
decisions (tasks/lake/decision_log.py) weighed by each policy's greedy choices (agents/ope.py:
IPS, SNIPS, the direct method and doubly robust, each with its bootstrap 95% interval and effective
sample size). The direct method's reward model is fitted on the decisions learned from, not on those
it judges.

The decisions are judged one by one, each its own episode (a contextual bandit: a recommendation, a
price, an ad); a log whose outcomes continue episodes is refused in one line, before any training.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gymflow.agents.ope import (
    Decisions,
    Estimate,
    bootstrapped,
    checked_support,
    doubly_robust_terms,
    effective_sample_size,
    evaluate_decisions,
    importance_weights,
)
from gymflow.errors import GymflowError, InvalidPreset
from gymflow.tasks.lake.decision_log import (
    HeldOutPart,
    LoggedDecisions,
    held_out_of,
    logged_part,
    read_logged,
    request_buckets,
)
from gymflow.tasks.storage.objects import StorageLocation, open_storage

RIDGE = 1e-2  # the reward model's regularisation


@dataclass(frozen=True)
class HeldOutChoice:
    """Which held-out decisions: `share` of the log kept from learning, `part` of those, logged before
    `before` (unix time; None: all there when read)."""

    share: float
    part: HeldOutPart = "judging"
    before: float | None = None


@dataclass(frozen=True)
class HeldOutDecisions:
    logged: LoggedDecisions  # the decisions kept out of learning
    rewards_model: np.ndarray  # [N, A] the reward model's q(x, .) of each of them
    actions_n: int


def held_out_decisions(location: StorageLocation, source: HeldOutChoice, actions_n: int,
                       fields: tuple[str, str]) -> HeldOutDecisions:
    """The log's held-out decisions (`source`'s part of them) and a reward model fitted on those learned
    from; InvalidPreset (one line, naming `fields`: the log's, the share's) where the log cannot judge: no
    decisions, too few held out, episodes of several decisions, or no exploration to give other choices
    support."""
    field, share_field = fields
    try:
        logged = read_logged(open_storage(location), "", source.before)
    except GymflowError as error:
        raise InvalidPreset(field, error.problem) from None
    continuing = int(np.sum(~logged.terminal))
    if continuing:
        raise InvalidPreset(field, f"{continuing:,} of {len(logged.terminal):,} logged outcomes continue an episode: "
                                   "judge off_policy weighs one-step decisions; allowed: returns")
    if np.all(np.isclose(logged.log_probabilities, 0.0)):
        raise InvalidPreset(field, "every logged decision was the served policy's sure choice (probability 1): no "
                                   "other choice has support; serve with GYMFLOW_EXPLORATION=epsilon=E")
    buckets = request_buckets(logged.request_ids)
    kept, learning = held_out_of(buckets, source.share, source.part), ~held_out_of(buckets, source.share)
    if kept.sum() < 2 or learning.sum() < 2:
        raise InvalidPreset(share_field, f"{int(kept.sum())} of {len(kept)} logged decisions held out for "
                                         f"{source.part}: too few on one side to learn from and to judge on")
    learned = logged_part(logged, learning)
    judged = logged_part(logged, kept)
    model = fitted_reward_model(learned.observations, learned.actions, learned.rewards, actions_n)
    return HeldOutDecisions(judged, predicted_rewards(model, judged.observations), actions_n)


def score_off_policy(greedy: np.ndarray, held: HeldOutDecisions, seed: int = 0) -> dict[str, Estimate]:
    """What a policy acting greedily as `greedy` ([N] its actions on the held-out observations) would
    score, by each estimator; NoSupport where the log never took its actions."""
    return evaluate_decisions(greedy_decisions(greedy, held), seed)


def paired_difference(challenger: np.ndarray, champion: np.ndarray, held: HeldOutDecisions,
                      seed: int = 0) -> Estimate:
    """The challenger's value less the champion's (each acting greedily as given), on the same held-out
    decisions: each decision's doubly robust term of the one less the other's, their mean with its
    bootstrap interval. Paired, the decisions' own luck cancels out of the difference. Its ESS: the
    smaller of the two policies' weights'."""
    theirs = [greedy_decisions(actions, held) for actions in (challenger, champion)]
    for decisions in theirs:
        checked_support(decisions)
    terms = doubly_robust_terms(theirs[0]) - doubly_robust_terms(theirs[1])
    ess = min(effective_sample_size(importance_weights(decisions)) for decisions in theirs)
    return bootstrapped(lambda rows: float(np.mean(terms[rows])), len(terms), ess, seed)


def greedy_decisions(greedy: np.ndarray, held: HeldOutDecisions) -> Decisions:
    """The held-out decisions as OPE weighs them for a policy acting greedily as `greedy`."""
    logged = held.logged
    target = np.zeros((len(greedy), held.actions_n))
    target[np.arange(len(greedy)), np.asarray(greedy, dtype=np.int64)] = 1.0
    logged_probs = np.exp(logged.log_probabilities)
    sure = np.isclose(logged_probs, 1.0)  # a greedy log: its other actions had probability 0
    behaviour = None
    if sure.any():
        behaviour = np.full_like(target, np.nan)
        behaviour[sure] = 0.0
        behaviour[sure, logged.actions[sure].astype(np.int64)] = 1.0
        behaviour = np.where(np.isnan(behaviour), 1.0, behaviour)  # unknown: taken as possible
    return Decisions(logged.actions.astype(np.int64), logged.rewards.astype(np.float64), logged_probs, target,
                     held.rewards_model, behaviour)


def fitted_reward_model(observations: np.ndarray, actions: np.ndarray, rewards: np.ndarray,
                        actions_n: int) -> np.ndarray:
    """[A, F] a ridge regression of the reward on the observation's features, one an action (an
    action never taken predicts the mean reward)."""
    features = _features(observations)
    weights = np.zeros((actions_n, features.shape[1]))
    for action in range(actions_n):
        rows = actions == action
        if not rows.any():
            weights[action, -1] = float(np.mean(rewards))
            continue
        x, y = features[rows], rewards[rows].astype(np.float64)
        weights[action] = np.linalg.solve(x.T @ x + RIDGE * np.eye(x.shape[1]), x.T @ y)
    return weights


def predicted_rewards(weights: np.ndarray, observations: np.ndarray) -> np.ndarray:
    return _features(observations) @ weights.T


def _features(observations: np.ndarray) -> np.ndarray:
    """The observation, its squares and a constant."""
    flat = observations.reshape(len(observations), -1).astype(np.float64)
    return np.concatenate([flat, flat**2, np.ones((len(flat), 1))], axis=1)


