"""What a run keeps in storage: policies while they may be asked for, the newest checkpoints, and
the shards a resume from them reads; and that a run killed right after a deletion resumes to the
same end. In-process (tests/in_process.py), on a local folder."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gymflow.presets.model import OpponentPool
from gymflow.tasks.storage.checkpoints import committed_versions, read_policy, versions_on
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage
from gymflow.tasks.storage.retention import ShardFloor
from gymflow.tasks.training.commits import Commits
from gymflow.tasks.training.learning import create_learner
from gymflow.tasks.training.ledger import segment_versions
from gymflow.tasks.training.resume import restore
from gymflow.tasks.training.run import PreparedRun
from gymflow.tasks.training.state import LoopState
from tests.in_process import prepared, train_in_process
from tests.stored import read_ledger

# the loop's heatup and evaluations are Prefect tasks: they run as task runs of the session's API
pytestmark = pytest.mark.usefixtures("prefect_api")


class FlowDied(Exception):
    """Stands for SIGKILL: the flow stops between two storage operations."""


def die_after_deleting_shards(storage: Storage, monkeypatch, deletions: int) -> None:
    """The flow dies right after its `deletions`-th deletion of shards."""
    delete, seen = storage.delete, []

    def deleting(keys):
        keys = list(keys)
        delete(keys)
        if any("/shards/" in key for key in keys):
            seen.append(keys)
            if len(seen) == deletions:
                raise FlowDied(f"after deleting {keys}")

    monkeypatch.setattr(storage, "delete", deleting)


def shard_keys(run: PreparedRun) -> list[str]:
    return run.storage.list(RunLayout(run.run_id).shards)


@pytest.fixture
def small_replay(tiny_budget) -> dict:
    """SYNC DQN: heatup's 128 env steps, then 9 rounds of 128; a replay memory of two rounds; a
    checkpoint at every version, one kept."""
    return {**tiny_budget, "agent.train_steps_per_iteration": 8, "agent.hidden_sizes": [16],
            "agent.replay_capacity": 256, "schedule.heatup_env_steps": 128, "schedule.total_env_steps": 1280,
            "storage.checkpoint_every_env_steps": 128, "storage.keep_checkpoints": 1}


def best_evaluated(observer) -> int:
    """The version a run delivers: its best evaluation's (the later of equals)."""
    return max(reversed(observer.evaluations), key=lambda scored: scored.mean_return).version


def test_a_sync_run_keeps_the_newest_checkpoint_and_the_shards_its_resume_reads(small_replay, tmp_path):
    run = prepared(tmp_path, "cartpole-dqn", small_replay)
    state, observer, _ = train_in_process(run)
    layout, best = RunLayout(run.run_id), best_evaluated(observer)
    assert state.version == 9
    assert committed_versions(run.storage, layout) == sorted({best, 9})  # the delivered one's kept beside it
    # the replay memory held rounds 7 and 8 (256 transitions); round 8's shards also hold the envs' cursors (a
    # delivered version's checkpoint holds no experience back: a resume reads the newest)
    assert shard_keys(run) == [layout.shard(v, w) for v in (7, 8) for w in (0, 1)]
    # policies: the newest and max_policy_lag + 1 behind it, for rollouts that may still ask, and the delivered one
    window = range(9 - run.preset.distribution.max_policy_lag - 1, 10)
    assert versions_on(run.storage, layout.policies) == sorted({best, *window})


def test_keep_shards_all_keeps_every_shard(small_replay, tmp_path):
    run = prepared(tmp_path, "cartpole-dqn", {**small_replay, "storage.keep_shards": "all"})
    _, observer, _ = train_in_process(run)
    layout = RunLayout(run.run_id)
    rounds = [layout.shard(v, w) for v in range(9) for w in (0, 1)]
    assert shard_keys(run) == sorted([layout.shard(None, 0), layout.shard(None, 1), *rounds])
    assert committed_versions(run.storage, layout) == sorted({best_evaluated(observer), 9})  # pruned all the same


@pytest.mark.parametrize("deletions", [1, 4])
def test_a_sync_run_killed_right_after_deleting_shards_resumes_to_the_same_end(small_replay, tmp_path, monkeypatch,
                                                                               deletions):
    clean = prepared(tmp_path / "clean", "cartpole-dqn", small_replay)
    clean_state, _, _ = train_in_process(clean)
    died = prepared(tmp_path / "died", "cartpole-dqn", small_replay)
    with monkeypatch.context() as patch:
        die_after_deleting_shards(died.storage, patch, deletions)
        with pytest.raises(FlowDied):
            train_in_process(died)
    learner = create_learner(died.experiment)
    restored = restore(died.storage, died.run_id, learner, died.preset)  # the replay memory from the shards left
    state, _, _ = train_in_process(PreparedRun(died.experiment, died.run_id, died.storage, learner, restored))
    assert state == clean_state
    policy = ["policy.safetensors"]
    assert (read_policy(died.storage, RunLayout(died.run_id), state.version, policy)
            == read_policy(clean.storage, RunLayout(clean.run_id), state.version, policy))
    for mine, theirs in zip(learner.replay.state_dict().values(), clean.learner.replay.state_dict().values()):
        assert (mine == theirs).all()
    assert shard_keys(died) == [key.replace(clean.run_id, died.run_id) for key in shard_keys(clean)]


def test_an_async_run_keeps_a_replay_window_of_chunks_and_resumes_after_a_deletion(async_budget, tmp_path,
                                                                                   monkeypatch):
    budget = {**async_budget, "agent.replay_capacity": 128, "storage.checkpoint_every_env_steps": 64,
              "storage.keep_checkpoints": 1, "schedule.total_env_steps": 1536}
    run = prepared(tmp_path, "cartpole-dqn", budget)
    with monkeypatch.context() as patch:
        die_after_deleting_shards(run.storage, patch, 3)
        with pytest.raises(FlowDied):
            train_in_process(run)
    learner = create_learner(run.experiment)
    restored = restore(run.storage, run.run_id, learner, run.preset)  # checks the memory ends where it stood
    state, _, _ = train_in_process(PreparedRun(run.experiment, run.run_id, run.storage, learner, restored))
    assert state.env_steps >= 1536
    layout = RunLayout(run.run_id)
    chunks = [key for key in shard_keys(run) if "/async/" in key]
    # 32 env steps a chunk: the 128-transition window is 4 chunks, plus what landed since the
    # checkpoint and each worker's cursor; far fewer than the run's 46 chunks
    assert 4 <= len(chunks) <= 12 and not any("/heatup/" in key for key in shard_keys(run))
    assert len(segment_versions(run.storage, layout)) <= 8
    ledger = read_ledger(run.storage, run.run_id)
    assert ledger.counts.shards_inserted + ledger.counts.shards_dropped >= 1536 // 32 - 2


def test_policies_retire_outside_the_window_unless_an_evaluation_is_scoring_them(tiny_budget, tmp_path):
    run = prepared(tmp_path, "cartpole-ppo", tiny_budget)
    checkpoints = Commits(run.storage, run.run_id, run.preset.storage, policy_window=2)
    for version in range(11):
        checkpoints.publish(run.learner, version, pinned={3} if version < 10 else set())
        if version == 9:
            checkpoints.retirement.wait()  # retiring runs beside the commits
            assert versions_on(run.storage, RunLayout(run.run_id).policies) == [3, 7, 8, 9]
    checkpoints.close()
    assert versions_on(run.storage, RunLayout(run.run_id).policies) == [8, 9, 10]


def test_a_pool_s_snapshots_stay_while_a_kept_checkpoint_s_rounds_may_face_them(tiny_budget, tmp_path):
    run = prepared(tmp_path, "cartpole-ppo", tiny_budget)
    pool = OpponentPool(size=2, every=3)
    checkpoints = Commits(run.storage, run.run_id, run.preset.storage.model_copy(update={"keep_checkpoints": 1}),
                          policy_window=1, pool=pool)
    layout = RunLayout(run.run_id)
    for version in range(14):
        checkpoints.publish(run.learner, version)
        if version in (7, 13):
            state = replace(LoopState.start(2, 0), version=version)
            checkpoints.checkpoint(run.learner, state, ShardFloor(2, heatup=True))
        checkpoints.retirement.wait()
        if version == 12:  # the kept checkpoint v7's rounds face [3, 6], then 9 and 12: none older than 3
            assert versions_on(run.storage, layout.policies) == [3, 6, 9, 11, 12]
    assert committed_versions(run.storage, layout) == [13]
    checkpoints.publish(run.learner, 14)  # v13's pool is [9, 12]: 3 and 6 are no longer faced from any checkpoint
    checkpoints.close()
    assert versions_on(run.storage, layout.policies) == [9, 12, 13, 14]


def test_a_rising_floor_frees_exactly_what_a_listing_would_find():
    layout = RunLayout("run")
    stored = ([layout.shard(None, w) for w in (0, 1)] + [layout.shard(v, w) for v in range(6) for w in (0, 1)]
              + [layout.chunk(w, c) for w in (0, 1) for c in range(8)] + [layout.ledger_segment(v) for v in (0, 3, 6, 9)])
    earlier = ShardFloor(2, heatup=True, round=1, chunks=(2, 1), segment=3)
    later = ShardFloor(2, heatup=False, round=4, chunks=(5, 1), segment=7)
    listed = {key for key in stored if earlier.needs(key) and not later.needs(key)}
    assert set(later.released_since(earlier, layout)) & set(stored) == listed
    assert layout.chunk(0, 4) in listed and layout.chunk(1, 1) not in listed and layout.ledger_segment(6) in listed
