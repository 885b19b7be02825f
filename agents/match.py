"""A match between two policies on a two-player PettingZoo env: seeded games, sides swapped every
other game, both acting greedily; the first policy's score with a Wilson interval.

The building block of self-play's judging: a challenger beats a champion when its score's
interval lies above one half.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from gymflow.agents.core import Policy
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


def play_match(first: Policy, second: Policy, env_id: str, env_kwargs: dict[str, Any], games: int,
               seed: int) -> MatchResult:
    """`games` games from seeds derived from `seed`: `first` plays agent 0 in even games and agent 1
    in odd ones; a game is won by the side with the higher return."""
    margins, _ = play_games(first, second, env_id, env_kwargs, games, seed)
    return MatchResult(int((margins > 0).sum()), int((margins == 0).sum()), int((margins < 0).sum()))


def game_scores(margins: np.ndarray) -> np.ndarray:
    """The first policy's score in each game: 1 a win, 0.5 a draw, 0 a loss."""
    return (margins > 0) + 0.5 * (margins == 0)


def play_games(first: Policy, second: Policy, env_id: str, env_kwargs: dict[str, Any], games: int,
               seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`play_match`'s games: the first policy's return minus the second's in each, and each game's
    length."""
    env = SeededAgentVectorEnv(env_id, env_kwargs, games, seed)
    if env.per_game != 2:
        raise ValueError(f"{env_id!r} has {env.per_game} agents a game; a match is between two")
    firsts = np.array([2 * game + game % 2 for game in range(games)])
    seconds = firsts ^ 1  # the other row of each game
    returns, shape = np.full(env.num_envs, np.nan), env.action_space.shape
    lengths = np.zeros(env.num_envs, dtype=np.int64)
    env.reset()
    while np.isnan(returns).any():
        actions = np.zeros((env.num_envs, *env.action_space.shape), dtype=np.float32 if shape else np.int64)
        actions[firsts] = first.act(env.obs[firsts], explore=False)[0]
        actions[seconds] = second.act(env.obs[seconds], explore=False)[0]
        step = env.step(np.clip(actions, env.action_space.low, env.action_space.high) if shape else actions)
        for row, episode_return, length in zip(step.done_envs, step.episode_returns, step.episode_lengths):
            if np.isnan(returns[row]):
                returns[row], lengths[row] = episode_return, length
    env.close()
    return returns[firsts] - returns[seconds], np.maximum(lengths[firsts], lengths[seconds])
