"""A PettingZoo run's stored experience as each agent's episodes.

Its rollouts have a row per agent of each game (envs/agents.py): row g * K + k is agent k of game
g. An agent's episode is its life in one episode of its game: from the game's reset, seeded
`derive_seed(env_seed, g, i)`, to the step the agent left or the game ended. A row that has left
idles (not alive) until its game starts again: those steps are nobody's. A self-play run's rows
played by a past version are not alive either, so an agent's episode is whole only where every
step of its life was alive in the shards (the learner's own experience).

A game's episode ends at the step its last agent leaves; the next begins on the step after. A
stream that starts at the worker's first shard places every game at episode 0 there; one whose
first shards were retired places each game where the cursor shows an episode of it began.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from gymflow.envs.seeding import derive_seed
from gymflow.tasks.lake.episodes import Episode, WorkerStream, acting_version
from gymflow.tasks.storage.layout import parse_shard_key
from gymflow.tasks.storage.objects import Storage
from gymflow.tasks.storage.shards import ShardError, StoredShard, read_stored_shard


@dataclass
class _Game:
    """Where one game stands: its episode number, the stream step that episode began at, and the
    rows that have left it."""

    index: int
    began: int
    left: set[int] = field(default_factory=set)


class AgentEpisodeStitcher:
    """Reads one worker's shards of a PettingZoo run and hands back the whole episodes of the
    agents `keep` (indices within a game), in the order they ended; each observation is the
    agent's own, a row's first `observed` entries (its index and the game's state dropped)."""

    def __init__(self, stream: WorkerStream, env_seed: int, per_game: int, keep: frozenset[int], observed: int,
                 first_order: int):
        self.stream = stream
        self.env_seed = env_seed
        self.per_game = per_game
        self.keep = keep
        self.observed = observed
        # the order of the worker's first shard (-1: heatup's): a stream from there starts every game at episode 0
        self.from_the_start = parse_shard_key(stream.keys[0]).order == first_order
        self._games: list[_Game | None] = []
        self._pieces: dict[int, list[tuple[np.ndarray, ...]]] = {}  # per kept row: its alive steps so far
        self._offset = 0  # the stream step of the shard's first step
        self._last_obs: np.ndarray | None = None

    def read(self, storage: Storage) -> Iterator[Episode]:
        for key in self.stream.keys:
            yield from self.add(read_stored_shard(storage, key))

    def add(self, shard: StoredShard) -> Iterator[Episode]:
        rollout = shard.rollout
        if rollout.alive is None:
            raise ShardError(f"shard {shard.key} holds no agents' rows")
        steps, rows = rollout.rewards.shape
        if self._last_obs is None:
            self._games = [_Game(0, 0) if self.from_the_start else None for _ in range(rows // self.per_game)]
        elif not np.array_equal(rollout.obs[0], self._last_obs):
            raise ShardError(f"shard {shard.key} does not continue the games of the shard before it")
        ends = sorted((int(flat) // rows, int(flat) % rows, row) for row, flat in enumerate(rollout.done_index))
        version = acting_version(shard)
        for game in range(len(self._games)):
            yield from self._play(shard, game, [end for end in ends if end[1] // self.per_game == game], version)
        self._offset += steps
        self._last_obs = rollout.last_obs

    def _play(self, shard: StoredShard, game: int, ends: list[tuple[int, int, int]], version: int) -> Iterator[Episode]:
        """Game `game`'s steps of the shard: each (step, row, done_obs row) of `ends` ends an agent's life."""
        steps = len(shard.rollout.rewards)
        rows = range(game * self.per_game, (game + 1) * self.per_game)
        state = self._games[game] or self._placed(shard, game)
        if state is None:  # no episode of the game is known to begin before this shard's end
            return
        start = {row: max(state.began - self._offset, 0) for row in rows}
        for step, row, final in ends:
            if step < start[row]:
                continue  # before the game was placed
            self._keep(shard, row, start[row], step + 1, version)
            start[row] = step + 1
            yield from self._finish(shard, state, row, step, final)
            state.left.add(row)
            if len(state.left) == self.per_game:  # its last agent left: the game's next episode begins
                state.index, state.began, state.left = state.index + 1, self._offset + step + 1, set()
        for row in rows:
            self._keep(shard, row, start[row], steps, version)
        if state.index != int(shard.cursor.episode_index[rows.start]):
            raise ShardError(f"shard {shard.key}: game {game} is at episode {state.index}, its cursor says "
                             f"{int(shard.cursor.episode_index[rows.start])}")
        self._games[game] = state

    def _placed(self, shard: StoredShard, game: int) -> _Game | None:
        """The game's episode that the cursor shows began in this shard, if one did."""
        row = game * self.per_game
        since = int(shard.cursor.action_counts[row])  # the game's steps since its episode began
        steps = len(shard.rollout.rewards)
        if since > steps:
            return None
        for agent_row in range(row, row + self.per_game):
            self._pieces.pop(agent_row, None)
        return _Game(int(shard.cursor.episode_index[row]), self._offset + steps - since)

    def _keep(self, shard: StoredShard, row: int, start: int, stop: int, version: int) -> None:
        if stop <= start or row % self.per_game not in self.keep:
            return
        r = shard.rollout
        alive = r.alive[start:stop, row]
        if alive.any():
            steps = slice(start, stop)
            self._pieces.setdefault(row, []).append((r.obs[steps, row, : self.observed][alive],
                                                     r.actions[steps, row][alive], r.rewards[steps, row][alive],
                                                     np.full(int(alive.sum()), version, dtype=np.int64)))

    def _finish(self, shard: StoredShard, state: _Game, row: int, step: int, final: int) -> Iterator[Episode]:
        """Row `row` left at `step`: its episode, if every step of its life was kept."""
        pieces = self._pieces.pop(row, [])
        life = self._offset + step + 1 - state.began
        if row % self.per_game not in self.keep or sum(len(piece[1]) for piece in pieces) != life:
            return
        obs, actions, rewards, versions = (np.concatenate(part) for part in zip(*pieces))
        r = shard.rollout
        game = row // self.per_game
        yield Episode(
            worker=self.stream.worker, env=game, agent=row % self.per_game, index=state.index,
            seed=derive_seed(self.env_seed, game, state.index),
            observations=np.concatenate([obs, r.done_obs[final][None, : self.observed]]), actions=actions,
            rewards=rewards,
            terminated=bool(r.terminated[step, row]) and not bool(r.truncated[step, row]),
            life_lost=np.zeros(len(actions), dtype=bool), policy_versions=versions,
        )
