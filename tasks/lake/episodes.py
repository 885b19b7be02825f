"""A run's stored experience as whole episodes.

Each rollout worker's shards continue one another: heatup's, then one a round (SYNC) or its
stream of chunks (ASYNC), each starting where the previous one's env cursor stood. Read in that
order and split env by env at the steps that ended an episode, they give back every episode the
worker's envs played, each with the seed its reset took. A worker whose first shards were retired
(storage.keep_shards: needed) starts mid-episode: its envs are read from their first whole episode.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from gymflow.envs.seeding import derive_seed
from gymflow.tasks.storage.layout import RunLayout, parse_shard_key
from gymflow.tasks.storage.objects import Storage
from gymflow.tasks.storage.shards import NO_POLICY, ShardError, StoredShard, read_stored_shard

UNKNOWN_VERSION = -2  # an ASYNC chunk written before shards recorded their policy version


@dataclass(frozen=True)
class Episode:
    """One episode of one env of one rollout worker, as it was collected."""

    worker: int
    env: int
    index: int  # the env's episode number: it began at reset(seed=seed)
    seed: int
    observations: np.ndarray  # [T + 1, *obs]: the first observation, then what each step led to
    actions: np.ndarray  # [T, *action]
    rewards: np.ndarray  # [T] float32, as the learner saw them (Atari: clipped to their sign)
    terminated: bool  # its last step ended it (else the episode was cut: truncated)
    life_lost: np.ndarray  # [T] bool: a step that lost a life, the game going on (Atari)
    policy_versions: np.ndarray  # [T] int64: the version that chose each action (-1: heatup's random policy)
    agent: int | None = None  # a PettingZoo run's: the agent's index in its game (`env` is then the game)

    @property
    def steps(self) -> int:
        return len(self.actions)


@dataclass(frozen=True)
class WorkerStream:
    """One rollout worker's shards in the order it collected them."""

    worker: int
    keys: tuple[str, ...]

    @property
    def first_kept(self) -> str:
        """Its first shard, by round (v000003) or chunk (chunk 12)."""
        return parse_shard_key(self.keys[0]).name


def worker_streams(storage: Storage, layout: RunLayout) -> list[WorkerStream]:
    """Every rollout worker's stored shards, heatup's first, then by round or chunk number."""
    streams: dict[int, list[tuple[int, str]]] = {}
    for key in storage.list(layout.shards):
        if shard := parse_shard_key(key):
            streams.setdefault(shard.worker, []).append((shard.order, key))
    return [WorkerStream(worker, tuple(key for _, key in sorted(keys))) for worker, keys in sorted(streams.items())]


def acting_version(shard: StoredShard) -> int:
    """The policy version that collected a shard: recorded in it, else read from its key."""
    if shard.policy_version is not None:
        return shard.policy_version
    key = parse_shard_key(shard.key)
    return NO_POLICY if key.heatup else key.round if key.round is not None else UNKNOWN_VERSION


@dataclass
class _Open:
    """An env's episode so far: the pieces of it each shard held."""

    index: int
    whole: bool  # its beginning was read (else it began in a retired shard: it is skipped)
    pieces: list[tuple[np.ndarray, ...]] = field(default_factory=list)


class EpisodeStitcher:
    """Reads one worker's shards in order and hands back the episodes each one completes."""

    def __init__(self, stream: WorkerStream, env_seed: int, newest_frame: bool):
        self.stream = stream
        self.env_seed = env_seed
        self.newest_frame = newest_frame  # frame stacks [k, h, w]: keep each step's newest frame
        self._open: list[_Open] = []
        self._last_obs: np.ndarray | None = None
        self.from_the_start: bool | None = None  # known at the first shard: every env at its first step

    def read(self, storage: Storage) -> Iterator[Episode]:
        """Every whole episode of the stream, in the order they ended."""
        for key in self.stream.keys:
            yield from self.add(read_stored_shard(storage, key))

    def add(self, shard: StoredShard) -> Iterator[Episode]:
        rollout = shard.rollout
        steps, envs = rollout.rewards.shape
        ends = [[] for _ in range(envs)]  # per env: (step, row of done_obs)
        for row, flat in enumerate(rollout.done_index):
            ends[int(flat) % envs].append((int(flat) // envs, row))
        if self._last_obs is None:
            self._open = [self._first_episode(shard, env, ends[env]) for env in range(envs)]
            self.from_the_start = all(episode.index == 0 and episode.whole for episode in self._open)
        elif not np.array_equal(rollout.obs[0], self._last_obs):
            raise ShardError(f"shard {shard.key} does not continue the envs of the shard before it")
        version = acting_version(shard)
        for env in range(envs):
            yield from self._split(shard, env, ends[env], version)
            if self._open[env].index != int(shard.cursor.episode_index[env]):
                raise ShardError(f"shard {shard.key}: env {env} is at episode {self._open[env].index}, its cursor "
                                 f"says {int(shard.cursor.episode_index[env])}")
        self._last_obs = rollout.last_obs

    @staticmethod
    def _first_episode(shard: StoredShard, env: int, ends: list[tuple[int, int]]) -> _Open:
        """The episode env `env` is in at the stream's first step: whole if it began there (the
        first episode to end here is as long as the steps up to its end; else the env's actions
        since its reset are this shard's)."""
        if ends:
            step, row = ends[0]
            alive = shard.rollout.alive  # a C++ backend's FIRE presses are no steps of the episode's length
            policy_steps = step + 1 if alive is None else int(np.count_nonzero(alive[: step + 1, env]))
            began_here = int(shard.episode_lengths[row]) == policy_steps
        else:
            began_here = int(shard.cursor.action_counts[env]) == len(shard.rollout.rewards)
        return _Open(index=int(shard.cursor.episode_index[env]) - len(ends), whole=began_here)

    def _split(self, shard: StoredShard, env: int, ends: list[tuple[int, int]], version: int) -> Iterator[Episode]:
        rollout, start = shard.rollout, 0
        for step, row in ends:
            self._keep(shard, env, start, step + 1, version)
            finished = self._open[env]
            self._open[env] = _Open(index=finished.index + 1, whole=True)
            if finished.whole:
                yield self._episode(env, finished, rollout.done_obs[row], bool(rollout.terminated[step, env])
                                    and not bool(rollout.truncated[step, env]))
            start = step + 1
        self._keep(shard, env, start, len(rollout.rewards), version)

    def _keep(self, shard: StoredShard, env: int, start: int, stop: int, version: int) -> None:
        if stop > start and self._open[env].whole:
            r = shard.rollout
            self._open[env].pieces.append((self._frames(r.obs[start:stop, env]), r.actions[start:stop, env],
                                           r.rewards[start:stop, env], r.terminated[start:stop, env],
                                           np.full(stop - start, version, dtype=np.int64)))

    def _episode(self, env: int, finished: _Open, final_obs: np.ndarray, terminated: bool) -> Episode:
        obs, actions, rewards, terminal, versions = (np.concatenate(part) for part in zip(*finished.pieces))
        life_lost = terminal.copy()
        life_lost[-1] = False  # the last step's flag is the episode's own end
        return Episode(
            worker=self.stream.worker, env=env, index=finished.index,
            seed=derive_seed(self.env_seed, env, finished.index),
            observations=np.concatenate([obs, self._frames(final_obs[None])]), actions=actions, rewards=rewards,
            terminated=terminated, life_lost=life_lost, policy_versions=versions,
        )

    def _frames(self, obs: np.ndarray) -> np.ndarray:
        return obs[:, -1] if self.newest_frame else obs

