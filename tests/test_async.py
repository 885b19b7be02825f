"""ASYNC training end to end: real Dask worker processes keep collecting while the learner
trains; the lag bound drops what it should; every shard is accounted for once; a run stops with
nothing left running; on-policy agents are refused."""

from __future__ import annotations

import time

import numpy as np
import pytest
from distributed import Client, LocalCluster
from mlflow.tracking import MlflowClient

from gymflow.flows.improve import improve
from gymflow.presets import InvalidPreset
from gymflow.tasks.storage.checkpoints import committed_versions, read_checkpoint, versions_on
from gymflow.tasks.storage.codec import decode_arrays
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage, StorageLocation
from gymflow.tasks.training.state import LoopState
from tests.conftest import local_overrides, written_files
from tests.stored import read_ledger

pytestmark = pytest.mark.e2e

def _chunk_shards(storage: Storage, run_id: str) -> list[str]:
    return storage.list(f"{RunLayout(run_id).prefix}/shards/async")


@pytest.fixture(scope="module")
def external_cluster():
    """Two Dask worker processes the flow does not own, so what is left on them afterwards shows."""
    with (LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
          Client(cluster) as client):
        yield cluster.scheduler_address, client


def test_an_async_run_accounts_for_every_shard_and_stops_with_nothing_running(prefect_api, workspace, external_cluster, async_budget):
    address, client = external_cluster
    # every chunk kept: a dropped chunk below the envs' cursor floor is otherwise retired while the run goes on
    overrides = {**async_budget, **local_overrides(workspace), "distribution.scheduler_address": address,
                 "storage.shared": True, "storage.keep_shards": "all"}
    summary = improve("cartpole-dqn", overrides)

    # nothing of the run is queued or running on the cluster, its job hosts are gone, and nothing
    # is written afterwards
    assert all(not tasks for tasks in client.processing().values())
    assert sum(client.run(lambda dask_worker: dask_worker.state.executing_count).values()) == 0
    assert sum(client.run(lambda dask_worker: len(dask_worker.state.actors)).values()) == 0
    storage = Storage(StorageLocation(str(workspace / "data")))
    shards_at_stop = _chunk_shards(storage, summary.run_id)
    time.sleep(1.0)
    assert _chunk_shards(storage, summary.run_id) == shards_at_stop

    # every chunk landed once: inserted, dropped by the lag bound, or landed after the stop
    ledger = read_ledger(storage, summary.run_id)
    accounted = ledger.inserted + ledger.dropped + ledger.unused
    assert sorted(accounted) == shards_at_stop and len(set(accounted)) == len(accounted)
    assert summary.env_steps >= 1024 and summary.env_steps == 64 + 32 * len(accounted)
    assert ledger.counts.sampled / ledger.counts.inserted_steps == pytest.approx(4, rel=0.15)  # the ratio held
    final, layout = summary.versions_committed - 1, RunLayout(summary.run_id)
    assert committed_versions(storage, layout)[-1] == versions_on(storage, layout.policies)[-1] == final
    assert summary.versions_committed > 10

    mlflow = MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}")
    metrics = mlflow.get_run(summary.mlflow_run_id).data.metrics
    for name in ("async/policy_lag_mean", "async/policy_lag_max", "async/shard_age_seconds", "async/shards_dropped",
                 "async/inserts_per_second", "async/samples_per_second", "eval/return_mean"):
        assert name in metrics, name
    assert metrics["async/shards_dropped"] == len(ledger.dropped)


def test_the_lag_bound_drops_stale_shards_and_counts_them(prefect_api, workspace, async_budget):
    # a commit every gradient step, so most chunks land more than 0 versions behind
    overrides = {**async_budget, **local_overrides(workspace), "distribution.max_policy_lag": 0,
                 "distribution.commit_every_train_steps": 1, "schedule.total_env_steps": 512,
                 "agent.replay": "prioritized", "storage.checkpoint_replay": True, "storage.keep_shards": "all"}
    summary = improve("cartpole-dqn", overrides)
    storage = Storage(StorageLocation(str(workspace / "data")))
    ledger = read_ledger(storage, summary.run_id)
    assert ledger.dropped and ledger.inserted
    lags = dict(ledger.lags)
    assert all(lags[key] > 0 for key in ledger.dropped)
    assert all(lags[key] == 0 for key in ledger.inserted)
    assert summary.shards_dropped == len(ledger.dropped)
    # only the admitted shards reached replay: heatup plus the inserted chunks
    final = read_checkpoint(storage, RunLayout(summary.run_id), summary.versions_committed - 1, ["replay.npz"])
    replay = decode_arrays(final["replay.npz"])
    _, _, inserted = replay["counters"]
    assert inserted == 64 + ledger.counts.inserted_steps == 64 + 32 * len(ledger.inserted)
    assert not np.allclose(replay["priorities"], replay["priorities"][0])  # the learner updated them


@pytest.mark.parametrize("algo", ["sac", "td3"])
def test_an_actor_critic_trains_async_on_a_continuous_env(algo, prefect_api, workspace, async_budget):
    overrides = {**async_budget, **local_overrides(workspace), "env.id": "gymflow.testing.envs:ContinuousCorridor",
                 "agent": {"algo": algo, "hidden_sizes": [32], "batch_size": 16}, "schedule.total_env_steps": 512}
    summary = improve("cartpole-dqn", overrides)
    assert summary.env_steps >= 512 and summary.final_return is not None
    assert (workspace / "data" / "runs" / summary.run_id / "ledger.json").exists()
    blobs = read_checkpoint(Storage(StorageLocation(str(workspace / "data"))), RunLayout(summary.run_id),
                            summary.versions_committed - 1, ["loop_state.json"])
    assert LoopState.from_json(blobs["loop_state.json"]).stream.ledger.shards_inserted


@pytest.mark.parametrize(("overrides", "field"), [
    ({"distribution.mode": "async"}, "distribution.mode"),
    ({"agent.replay": "prioritized"}, "agent.replay"),
    ({"agent": {"algo": "sac"}}, "agent.algo"),
])
def test_refused_before_any_work_starts(prefect_api, workspace, overrides, field):
    with pytest.raises(InvalidPreset) as caught:
        improve("cartpole-ppo", {**overrides, **local_overrides(workspace)})
    assert caught.value.field == field
    assert written_files(workspace) == []
