"""Stitching a worker's shards into whole episodes (tasks/lake/episodes.py), on shards written
the way rollout jobs write them: every episode the envs played comes back once, whole, with the
seed its reset took; a stream with a shard missing in its middle is refused."""

from __future__ import annotations

import numpy as np
import pytest

from gymflow.agents.rollout import RandomPolicy, collect
from gymflow.envs.make import make_env
from gymflow.envs.vector import SeededVectorEnv
from gymflow.tasks.lake.episodes import EpisodeStitcher, WorkerStream, worker_streams
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage, StorageLocation
from gymflow.tasks.storage.shards import Collected, ShardError, write_shard

CORRIDOR = "gymflow.testing.envs:Corridor"
LAYOUT = RunLayout("run")
ENV_SEED = 7


def _write_rounds(storage: Storage, rounds: int, envs: int = 3, steps: int = 20, heatup: bool = False) -> list[float]:
    """A worker's rounds as shards (heatup's, then v0, v1, ...), its envs continuing; the returns of
    the episodes that ended."""
    env = SeededVectorEnv(CORRIDOR, {"max_steps": 12}, envs, ENV_SEED)
    env.reset()
    policy, returns = RandomPolicy(env.action_space, 0), []
    for version in ([None] if heatup else []) + list(range(rounds)):
        rollout, episodes = collect(policy, env, steps)
        write_shard(storage, LAYOUT.shard(version, 0), version, 0, Collected(rollout, episodes, env.cursor(), 0.0))
        returns += list(episodes.returns)
    return returns


def test_a_workers_rounds_give_back_every_episode_whole_with_its_seed(tmp_path):
    storage = Storage(StorageLocation(str(tmp_path)))
    returns = _write_rounds(storage, rounds=4)
    (stream,) = worker_streams(storage, LAYOUT)
    stitcher = EpisodeStitcher(stream, ENV_SEED, newest_frame=False)
    episodes = list(stitcher.read(storage))
    assert stitcher.from_the_start and len(episodes) == len(returns) > 10
    assert sorted(float(e.rewards.sum()) for e in episodes) == pytest.approx(sorted(returns))
    for episode in episodes:  # the env replays each from its seed and actions
        env = make_env(CORRIDOR, {"max_steps": 12})
        obs, _ = env.reset(seed=episode.seed)
        observed = [obs] + [env.step(int(action))[0] for action in episode.actions]
        np.testing.assert_array_equal(np.asarray(observed, np.float32), episode.observations)
        assert set(episode.policy_versions) <= {0, 1, 2, 3}
    by_env = {}
    for episode in episodes:
        by_env.setdefault(episode.env, []).append(episode.index)
    assert all(indices == list(range(len(indices))) for indices in by_env.values())  # none skipped, none twice


def test_a_stream_missing_a_shard_in_its_middle_is_refused(tmp_path):
    storage = Storage(StorageLocation(str(tmp_path)))
    _write_rounds(storage, rounds=3)
    storage.delete([LAYOUT.shard(1, 0)])
    (stream,) = worker_streams(storage, LAYOUT)
    with pytest.raises(ShardError, match="does not continue the envs of the shard before it"):
        list(EpisodeStitcher(stream, ENV_SEED, newest_frame=False).read(storage))


def test_a_stream_whose_first_shards_were_retired_starts_at_each_envs_first_whole_episode(tmp_path):
    storage = Storage(StorageLocation(str(tmp_path)))
    _write_rounds(storage, rounds=4)
    whole = list(EpisodeStitcher(worker_streams(storage, LAYOUT)[0], ENV_SEED, newest_frame=False).read(storage))
    storage.delete([LAYOUT.shard(0, 0)])
    (stream,) = worker_streams(storage, LAYOUT)
    assert stream == WorkerStream(0, tuple(LAYOUT.shard(v, 0) for v in (1, 2, 3)))
    stitcher = EpisodeStitcher(stream, ENV_SEED, newest_frame=False)
    after = list(stitcher.read(storage))
    assert not stitcher.from_the_start and 0 < len(after) < len(whole)
    kept = {(e.env, e.index): e for e in whole}
    for episode in after:  # each one of the run's own episodes, whole
        np.testing.assert_array_equal(episode.observations, kept[(episode.env, episode.index)].observations)
        assert episode.seed == kept[(episode.env, episode.index)].seed


def test_a_first_round_that_continues_a_retired_heatup_is_read_from_its_envs_first_whole_episodes(tmp_path):
    storage = Storage(StorageLocation(str(tmp_path)))
    _write_rounds(storage, rounds=8, heatup=True, steps=5)  # heatup's 5 steps leave every env mid-episode
    whole = list(EpisodeStitcher(worker_streams(storage, LAYOUT)[0], ENV_SEED, newest_frame=False).read(storage))
    storage.delete([LAYOUT.shard(None, 0)])
    (stream,) = worker_streams(storage, LAYOUT)
    assert stream.first_kept == "v000000"
    stitcher = EpisodeStitcher(stream, ENV_SEED, newest_frame=False)
    after = list(stitcher.read(storage))
    assert not stitcher.from_the_start and 0 < len(after) < len(whole)
    kept = {(e.env, e.index): e for e in whole}
    for episode in after:
        np.testing.assert_array_equal(episode.observations, kept[(episode.env, episode.index)].observations)
