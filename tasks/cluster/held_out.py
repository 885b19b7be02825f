"""A version scored on a decision log's held-out decisions (schedule.evaluate_on decisions), on a
rollout worker, with no env played: each decision's doubly robust term (agents/ope.py) is a return
of the evaluation, so their mean is the estimate and their spread its interval."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from gymnasium import spaces

from gymflow.agents.core import Policy
from gymflow.agents.ope import doubly_robust_terms
from gymflow.envs.make import env_spaces
from gymflow.tasks.cluster.messages import EvaluationResult, EvaluationSpec, HeldOutSource
from gymflow.tasks.lake.decision_log import logged_part
from gymflow.tasks.lake.off_policy import HeldOutChoice, HeldOutDecisions, greedy_decisions, held_out_decisions
from gymflow.tasks.storage.objects import StorageLocation

NO_FILM = "no env is played: schedule.evaluate_on decisions scores each version on held-out logged decisions"


@dataclass(frozen=True)
class Spaces:
    """What a policy's network is built for, without an env made to step."""

    observation_space: spaces.Space
    action_space: spaces.Space


def evaluate_on_decisions(spec: EvaluationSpec, policy_of: Callable[[Spaces], Policy]) -> EvaluationResult:
    """`spec`'s part of the held-out decisions, each its doubly robust term of the version's value."""
    assert spec.held_out is not None
    started = time.perf_counter()
    observation_space, action_space = env_spaces(spec.env_id, spec.env_kwargs, spec.preprocessing)
    held = _part(spec.run_id, spec.held_out, int(action_space.n))
    greedy, _ = policy_of(Spaces(observation_space, action_space)).act(held.logged.observations, explore=False)
    terms = doubly_robust_terms(greedy_decisions(greedy, held))
    return EvaluationResult(version=spec.policy_version, returns=tuple(float(term) for term in terms),
                            lengths=(1,) * len(terms), seconds=time.perf_counter() - started, no_film=NO_FILM)


def _part(run_id: str, source: HeldOutSource, actions_n: int) -> HeldOutDecisions:
    location, choice = source.location, HeldOutChoice(source.share, "selection", source.before)
    held = _held_out(run_id, location.root, json.dumps(location.options, sort_keys=True), location.outage_budget_s,
                     choice, actions_n)
    rows = np.array_split(np.arange(len(held.logged.actions)), source.parts)[source.part]
    return HeldOutDecisions(logged_part(held.logged, rows), held.rewards_model[rows], actions_n)


@lru_cache(maxsize=4)  # read once a worker and run, not once an evaluation (a long-lived worker: a new run rereads)
def _held_out(run_id: str, root: str, options: str, outage_budget_s: float, choice: HeldOutChoice, actions_n: int
              ) -> HeldOutDecisions:
    return held_out_decisions(StorageLocation(root, json.loads(options), outage_budget_s), choice, actions_n,
                              ("dataset.decisions", "dataset.holdout"))
