"""Rollout jobs in-process (the same functions Dask workers run): shards, keys, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from gymflow.presets import load_preset
from gymflow.presets.validate import resolve_experiment
from gymflow.tasks.cluster import jobs
from gymflow.tasks.cluster.rounds import RoundPlan
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import open_storage, storage_location
from gymflow.tasks.storage.shards import ShardError, read_shard
from gymflow.tasks.training.commits import Commits


@pytest.fixture
def experiment(tmp_path):
    return resolve_experiment(
        "cartpole-ppo",
        {"storage.root": str(tmp_path / "store"), "env.id": "gymflow.testing.envs:Corridor",
         "distribution.rollout_workers": 2, "distribution.envs_per_worker": 3, "schedule.rollout_steps_per_env": 20},
    )


def _commit_version(experiment, run_id: str, version: int) -> None:
    config = experiment.preset
    learner = experiment.algorithm.learner(config.agent, experiment.observation_space, experiment.action_space, config.seed)
    storage = open_storage(storage_location(config.storage))
    Commits(storage, run_id, config.storage, policy_window=10).publish(learner, version)


def _two_rounds(experiment, run_id: str, forget_live_envs: bool):
    config = experiment.preset
    for version in (0, 1):
        _commit_version(experiment, run_id, version)
    first = [jobs.run_rollout(spec) for spec in RoundPlan(config, run_id).rollouts(0, 0.0, [None, None])]
    if forget_live_envs:  # as if round 1 landed on other worker processes
        jobs._LIVE_ENVS.clear()
    second = [jobs.run_rollout(spec) for spec in RoundPlan(config, run_id).rollouts(1, 0.0, [r.key for r in first])]
    storage = open_storage(storage_location(config.storage))
    return [read_shard(storage, ref) for ref in first + second]


def test_a_round_continues_identically_from_live_envs_or_from_the_cursor_in_storage(experiment):
    live = _two_rounds(experiment, "live", forget_live_envs=False)
    rebuilt = _two_rounds(experiment, "rebuilt", forget_live_envs=True)
    for a, b in zip(live, rebuilt):
        for field_a, field_b in zip(a, b):
            np.testing.assert_array_equal(field_a, field_b)


def test_shard_keys_derive_from_run_version_and_worker_so_a_retry_overwrites(experiment):
    config = experiment.preset
    _commit_version(experiment, "r", 0)
    specs = RoundPlan(config, "r").rollouts(0, 0.0, [None, None])
    first = [jobs.run_rollout(spec) for spec in specs]
    jobs._LIVE_ENVS.clear()
    retried = [jobs.run_rollout(spec) for spec in specs]
    assert [r.key for r in first] == [RunLayout("r").shard(0, 0), RunLayout("r").shard(0, 1)]
    assert [r.sha256 for r in first] == [r.sha256 for r in retried]
    assert open_storage(storage_location(config.storage)).list(f"{RunLayout('r').prefix}/shards") == [r.key for r in first]


def test_a_shard_that_changed_after_its_rollout_is_refused(experiment):
    _commit_version(experiment, "t", 0)
    ref = jobs.run_rollout(RoundPlan(experiment.preset, "t").rollouts(0, 0.0, [None, None])[0])
    storage = open_storage(storage_location(experiment.preset.storage))
    storage.write(ref.key, storage.read(ref.key)[:-10])
    with pytest.raises(ShardError, match="does not match"):
        read_shard(storage, ref)


def test_evaluation_splits_episodes_across_workers_with_fixed_seeds(experiment):
    config = load_preset("cartpole-ppo", {"schedule.evaluation_episodes": 5, "distribution.rollout_workers": 2})
    specs = RoundPlan(config, "e").evaluations(3)
    assert [s.episodes for s in specs] == [3, 2]
    assert [s.seed for s in specs] == [s.seed for s in RoundPlan(config, "e").evaluations(9)]


def test_a_chunk_whose_newest_version_was_retired_meanwhile_acts_with_the_new_newest(experiment, monkeypatch):
    """The race the policy window allows: the job reads `latest` (v0), the learner publishes on and
    retires v0 before the job loads it. The job takes the new newest rather than failing."""
    run_id = "retired"
    for version in (0, 1, 2):
        _commit_version(experiment, run_id, version)
    storage = open_storage(storage_location(experiment.preset.storage))
    from gymflow.tasks.storage.checkpoints import retire_version

    retire_version(storage, RunLayout(run_id).policies, 0)
    pointer = iter([0, 2])  # as read before and after the retirement
    monkeypatch.setattr(jobs, "latest_policy_version", lambda storage, layout: next(pointer))
    shard = jobs.run_rollout(RoundPlan(experiment.preset, run_id).chunk(0, 0, 0.0, None))
    assert shard.version == 2 and shard.chunk == 0
