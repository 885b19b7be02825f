"""A match between two policies on a two-player PettingZoo env: seeded games, sides swapped every
other game, both acting greedily; the first policy's score with a Wilson interval.

The building block of self-play's judging: a challenger beats a champion when its score's
interval lies above one half.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gymflow.agents.core import Policy
from gymflow.agents.rollout import evaluate
from gymflow.envs.agents import SeededAgentVectorEnv


@dataclass(frozen=True)
class MatchResult:
    """The first policy's games: won, drawn and lost."""

    wins: int
    draws: int
    losses: int

    @property
    def games(self) -> int:
        return self.wins + self.draws + self.losses

    @property
    def score(self) -> float:
        """Wins, and half of each draw, per game."""
        return (self.wins + 0.5 * self.draws) / self.games

    def interval(self, z: float = 1.96) -> tuple[float, float]:
        """Wilson's score interval of `score` (95% by default)."""
        n, p = self.games, self.score
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        return centre - half, centre + half


def play_match(first: Policy, second: Policy, games: SeededAgentVectorEnv) -> MatchResult:
    """The games of a two-player env (one per game of `games`, from its seeds): `first` plays agent 0
    in even games and agent 1 in odd ones; a game is won by the side with the higher return."""
    margins, _ = play_games(first, second, games)
    return MatchResult(int((margins > 0).sum()), int((margins == 0).sum()), int((margins < 0).sum()))


def game_scores(margins: np.ndarray) -> np.ndarray:
    """The first policy's score in each game: 1 a win, 0.5 a draw, 0 a loss."""
    return (margins > 0) + 0.5 * (margins == 0)


def play_games(first: Policy, second: Policy, games: SeededAgentVectorEnv) -> tuple[np.ndarray, np.ndarray]:
    """`play_match`'s games, each played from its start to its end (the evaluation loop, both sides
    greedy): the first policy's return minus the second's in each, and each game's length."""
    if games.per_game != 2:
        raise ValueError(f"{games.per_game} agents a game; a match is between two")
    firsts = first_rows(games.num_envs)
    games.reset()
    played = evaluate(Sides(first, second, firsts), games)
    seconds = firsts ^ 1  # the other row of each game
    return played.returns[firsts] - played.returns[seconds], np.maximum(played.lengths[firsts],
                                                                        played.lengths[seconds])


def first_rows(rows: int) -> np.ndarray:
    """The first side's row in each two-player game of `rows` rows: agent 0 in even games, agent 1 in odd."""
    return np.array([2 * game + game % 2 for game in range(rows // 2)], dtype=np.int64)


class Sides:
    """Two policies acting as one: `first` for the rows `firsts`, `second` for the other row of each game."""

    def __init__(self, first: Policy, second: Policy, firsts: np.ndarray):
        self.first, self.second, self.firsts, self.seconds = first, second, firsts, firsts ^ 1

    def act(self, obs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        first, first_log_probs = self.first.act(obs[self.firsts], explore)
        second, second_log_probs = self.second.act(obs[self.seconds], explore)
        actions = np.empty((len(obs), *first.shape[1:]), dtype=first.dtype)
        log_probs = np.empty(len(obs), dtype=np.float32)
        actions[self.firsts], log_probs[self.firsts] = first, first_log_probs
        actions[self.seconds], log_probs[self.seconds] = second, second_log_probs
        return actions, log_probs
