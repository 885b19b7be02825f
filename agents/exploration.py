"""Exploration a deployment sets on a served policy, so the decisions it logs have support for
off-policy evaluation (agents/ope.py): each served action comes with its log-probability under the
policy that acted. Plain numpy; no env.

- greedy: the policy's own action (discrete: probability 1; a continuous policy logs nothing greedily:
  a point has no density)
- epsilon=E (discrete actions): a uniformly random action with probability E, else the greedy one;
  log pi(a|x) = log((1 - E) [a greedy] + E / n)
- noise=S (continuous actions): the greedy action plus Gaussian noise of standard deviation S times
  each dimension's half-range; the sample is logged with its log-density, and the env is sent it
  clipped to the action space's bounds, as gymflow's own training sends its samples
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

KINDS = ("greedy", "epsilon", "noise")


@dataclass(frozen=True)
class Exploration:
    kind: Literal["greedy", "epsilon", "noise"] = "greedy"
    scale: float = 0.0  # epsilon, or the noise's standard deviation as a share of each half-range

    @classmethod
    def parse(cls, text: str) -> Exploration:
        """`greedy`, `epsilon=0.1` or `noise=0.2`; a ValueError saying what is allowed otherwise."""
        kind, _, value = text.strip().partition("=")
        allowed = f"{text!r} is not an exploration; allowed: greedy, epsilon=E (0 < E <= 1), noise=S (S > 0)"
        if kind == "greedy" and not value:
            return cls()
        try:
            scale = float(value)
        except ValueError:
            raise ValueError(allowed) from None
        if kind == "epsilon" and 0 < scale <= 1 or kind == "noise" and 0 < scale < math.inf:
            return cls(kind, scale)
        raise ValueError(allowed)


@dataclass(frozen=True)
class Acted:
    actions: np.ndarray  # what the env is sent: [N] int64, or [N, *shape] float32 within the bounds
    logged: np.ndarray  # what the log keeps as the action: the same, or a continuous sample before its clip
    log_probabilities: np.ndarray  # [N] float64 of `logged` under the policy that acted


def explored(greedy: np.ndarray, exploration: Exploration, rng: np.random.Generator, actions_n: int | None = None,
             bounds: tuple[np.ndarray, np.ndarray] | None = None) -> Acted:
    """The actions served for greedy ones, with their log-probabilities; discrete actions give
    `actions_n`, continuous ones their `bounds` (low, high)."""
    if actions_n is not None:
        return _discrete(greedy, exploration, rng, actions_n)
    if bounds is None or exploration.kind != "noise":
        raise ValueError("a continuous policy's decisions have a density only with noise=S exploration")
    low, high = bounds
    sigma = exploration.scale * (high - low) / 2
    sample = (greedy + sigma * rng.standard_normal(greedy.shape)).astype(np.float32)
    z = (sample.astype(np.float64) - greedy) / sigma
    log_density = -0.5 * z**2 - np.log(sigma) - 0.5 * math.log(2 * math.pi)
    per_row = log_density.reshape(len(greedy), -1).sum(axis=1)
    return Acted(np.clip(sample, low, high).astype(np.float32), sample, per_row)


def _discrete(greedy: np.ndarray, exploration: Exploration, rng: np.random.Generator, actions_n: int) -> Acted:
    greedy = np.asarray(greedy, dtype=np.int64)
    if exploration.kind == "noise":
        raise ValueError("noise=S exploration is for continuous actions; a discrete policy takes epsilon=E")
    epsilon = exploration.scale if exploration.kind == "epsilon" else 0.0
    randomly = rng.random(len(greedy)) < epsilon
    actions = np.where(randomly, rng.integers(0, actions_n, len(greedy)), greedy)
    probabilities = (1 - epsilon) * (actions == greedy) + epsilon / actions_n
    return Acted(actions, actions, np.log(probabilities))


def epsilon_greedy_probabilities(greedy: np.ndarray, epsilon: float, actions_n: int) -> np.ndarray:
    """[N, n] pi(.|x) of an epsilon-greedy policy around greedy actions [N]: what OPE weighs with."""
    probabilities = np.full((len(greedy), actions_n), epsilon / actions_n)
    probabilities[np.arange(len(greedy)), greedy] += 1 - epsilon
    return probabilities
