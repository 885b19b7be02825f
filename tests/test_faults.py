"""Fault drills with real processes: a Dask worker SIGKILLed in the middle of a rollout (SYNC and
ASYNC), and a rollout that hangs. SYNC runs must finish with exactly their shards and versions,
and with the same weights as a clean run of the same preset and seed; ASYNC runs with every
chunk landed exactly once."""

from __future__ import annotations

import pytest

from gymflow.flows.improve import improve
from gymflow.tasks.storage.checkpoints import read_checkpoint
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage, StorageLocation
from tests.conftest import local_overrides

pytestmark = pytest.mark.e2e


@pytest.fixture
def drill(tiny_budget) -> dict:
    """10 rounds of 128 steps (64 a worker process), evaluated once at the end: the 300th step a
    worker process takes falls in the middle of its fifth rollout."""
    return {**tiny_budget, "env.id": "gymflow.testing.envs:Tripwire", "schedule.total_env_steps": 1280,
            "schedule.evaluate_every_env_steps": 100_000}


def _run(drill: dict, workspace, name: str, env_kwargs: dict, **extra):
    overrides = {**drill, **local_overrides(workspace), "storage.root": str(workspace / name), "env.kwargs": env_kwargs, **extra}
    summary = improve("cartpole-ppo", overrides)
    storage = Storage(StorageLocation(str(workspace / name)))
    layout = RunLayout(summary.run_id)
    final = summary.versions_committed - 1
    weights = read_checkpoint(storage, layout, final, ["policy.safetensors"])["policy.safetensors"]
    shards = storage.list(f"{layout.prefix}/shards")
    assert shards == sorted(f"{layout.prefix}/shards/v{v:06d}/w{w:03d}.npz" for v in range(final) for w in (0, 1))
    return summary, weights


@pytest.fixture
def clean_run(prefect_api, workspace, drill):
    return _run(drill, workspace, "clean", {"at_step": 10**9, "once_file": str(workspace / "never")})


def test_a_worker_sigkilled_mid_rollout_is_replaced_and_the_run_ends_as_a_clean_one(clean_run, workspace, drill):
    once = workspace / "killed.once"
    summary, weights = _run(drill, workspace, "killed", {"at_step": 300, "once_file": str(once), "fault": "kill"})
    killed_pid = int(once.read_text())  # the worker process that took SIGKILL, mid-step of a rollout
    pids = {int(process.split(":")[1]) for process in summary.rollout_processes}
    assert killed_pid in pids  # it had collected earlier rounds; others finished the run
    clean_summary, clean_weights = clean_run
    assert (summary.env_steps, summary.versions_committed) == (clean_summary.env_steps, clean_summary.versions_committed)
    assert weights == clean_weights


# default tier (one of its 25 slowest): the hanging-job drill kind
def test_a_hanging_rollout_is_timed_out_and_redone(clean_run, workspace, drill):
    once = workspace / "hung.once"
    summary, weights = _run(drill, workspace, "hung", {"at_step": 300, "once_file": str(once), "fault": "hang"},
                            **{"distribution.rollout_timeout_s": 5})
    assert once.exists()  # a rollout hung; the round timed out, its worker was restarted, the job redone
    clean_summary, clean_weights = clean_run
    assert summary.versions_committed == clean_summary.versions_committed
    assert weights == clean_weights


def test_an_async_worker_sigkilled_mid_chunk_loses_no_shard_and_counts_none_twice(prefect_api, workspace, async_budget):
    from gymflow.tasks.storage.checkpoints import committed_versions
    from tests.stored import read_ledger
    once = workspace / "killed.once"
    overrides = {**async_budget, **local_overrides(workspace), "env.id": "gymflow.testing.envs:Tripwire",
                 "env.kwargs": {"at_step": 300, "once_file": str(once), "fault": "kill"},
                 "storage.keep_shards": "all"}  # every shard the ledger names stays: a slow machine drops some (policy
    # lag), and retention may delete a dropped shard under a kept ledger segment (no resume reads it)
    summary = improve("cartpole-dqn", overrides)
    killed_pid = int(once.read_text())  # a worker process took SIGKILL in the middle of a chunk
    assert killed_pid in {int(process.split(":")[1]) for process in summary.rollout_processes}
    storage = Storage(StorageLocation(str(workspace / "data")))
    layout = RunLayout(summary.run_id)
    ledger = read_ledger(storage, summary.run_id)
    accounted = ledger.inserted + ledger.dropped + ledger.unused
    assert len(set(accounted)) == len(accounted)  # the rescheduled chunk landed once
    assert sorted(accounted) == storage.list(f"{layout.prefix}/shards/async")
    for worker in (0, 1):  # and no chunk number is missing
        chunks = sorted(int(key.rsplit("/c", 1)[1][:6]) for key in accounted if f"/w{worker:03d}/" in key)
        assert chunks == list(range(len(chunks)))
    assert summary.env_steps >= 1024
    assert committed_versions(storage, layout)[-1] == summary.versions_committed - 1


@pytest.mark.slow  # long tier: a hanging job timed out and redone stays in (the SYNC rollout's)
def test_an_async_chunk_that_hangs_is_timed_out_and_redone(prefect_api, workspace, async_budget):
    from tests.stored import read_ledger
    once = workspace / "hung.once"
    overrides = {**async_budget, **local_overrides(workspace), "env.id": "gymflow.testing.envs:Tripwire",
                 "env.kwargs": {"at_step": 300, "once_file": str(once), "fault": "hang"},
                 "distribution.rollout_timeout_s": 5, "schedule.total_env_steps": 768,
                 "storage.keep_shards": "all"}  # every shard the ledger names stays (as above)
    summary = improve("cartpole-dqn", overrides)
    assert once.exists()  # a chunk hung; its worker was restarted and the chunk submitted again
    storage = Storage(StorageLocation(str(workspace / "data")))
    ledger = read_ledger(storage, summary.run_id)
    accounted = ledger.inserted + ledger.dropped + ledger.unused
    assert len(set(accounted)) == len(accounted)
    assert sorted(accounted) == storage.list(f"{RunLayout(summary.run_id).prefix}/shards/async")
    assert summary.env_steps >= 768
