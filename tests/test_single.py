"""`distribution.mode: single`: the jobs run in the flow's own process, no Dask cluster, and the
run is the same as a SYNC run, byte for byte."""

from __future__ import annotations

import os
import threading

import psutil
import pytest

from gymflow.flows.improve import improve
from gymflow.presets import InvalidPreset
from gymflow.presets.validate import resolve_experiment
from gymflow.tasks.cluster.placement import workers_beyond_cores
from gymflow.tasks.storage.checkpoints import POLICY_BLOB, read_policy
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage, StorageLocation
from tests.conftest import local_overrides

DQN = {"agent.hidden_sizes": [32], "agent.batch_size": 16, "schedule.heatup_env_steps": 128,
       "agent.epsilon_decay_env_steps": 300}


class NewProcesses:
    """The command lines of the processes this one starts while inside, looked for every 20 ms."""

    def __init__(self) -> None:
        self.before = {child.pid for child in psutil.Process().children(recursive=True)}
        self.seen: dict[int, str] = {}
        self._done = threading.Event()

    def __enter__(self) -> NewProcesses:
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._done.wait(0.02):
            for child in psutil.Process().children(recursive=True):
                if child.pid not in self.before and child.pid not in self.seen:
                    try:
                        self.seen[child.pid] = " ".join(child.cmdline())
                    except psutil.Error:
                        self.seen[child.pid] = "(gone before it was looked at)"


def _final_policy(root, summary) -> bytes:
    return read_policy(Storage(StorageLocation(str(root))), RunLayout(summary.run_id),
                       summary.versions_committed - 1, [POLICY_BLOB])[POLICY_BLOB]


@pytest.mark.parametrize("preset, extra", [("cartpole-ppo", {}), ("cartpole-dqn", DQN)])
def test_a_single_run_starts_no_process_and_ends_byte_identical_to_a_sync_run(prefect_api, workspace, tiny_budget,
                                                                              preset, extra):
    run = {**tiny_budget, **local_overrides(workspace), **extra}
    synced = improve(preset, {**run, "storage.root": str(workspace / "sync")})
    with NewProcesses() as started:
        single = improve(preset, {**run, "storage.root": str(workspace / "single"), "distribution.mode": "single"})
    # no Dask worker, nanny or fork server (MLflow's model logging runs a Python of its own); the one
    # helper process that evaluated beside the learner has ended with the run
    assert not [command for command in started.seen.values() if "multiprocessing" in command or "dask" in command], \
        started.seen
    helpers = [pid for pid, command in started.seen.items() if "gymflow.tasks.cluster.wire" in command]
    assert len(helpers) == 1 and not psutil.pid_exists(helpers[0]), started.seen
    assert {process.split(":")[1] for process in single.rollout_processes} == {str(os.getpid())}
    assert single.versions_committed == synced.versions_committed
    assert _final_policy(workspace / "single", single) == _final_policy(workspace / "sync", synced)


def test_single_with_a_cluster_is_refused_in_one_line():
    with pytest.raises(InvalidPreset, match="^distribution.mode: single runs the jobs in the flow's process"):
        resolve_experiment("cartpole-ppo", {"distribution.mode": "single",
                                            "distribution.scheduler_address": "tcp://10.0.0.5:8786",
                                            "storage.shared": True})


def test_more_rollout_workers_than_cores_on_a_local_cluster_is_said_in_one_line():
    many = resolve_experiment("cartpole-ppo", {"distribution.rollout_workers": 3}).preset
    assert workers_beyond_cores(many, cores=2) == (
        "distribution.rollout_workers: 3 rollout workers do not fit this machine's 2 cores; its LocalCluster starts "
        "2 worker processes and the other rollouts of each round wait for them (fewer workers with more "
        "distribution.envs_per_worker step as many envs with less waiting)")
    assert workers_beyond_cores(many, cores=3) is None
    remote = resolve_experiment("cartpole-ppo", {"distribution.rollout_workers": 3, "storage.shared": True,
                                                 "distribution.scheduler_address": "tcp://10.0.0.5:8786"}).preset
    assert workers_beyond_cores(remote, cores=2) is None  # its cores are elsewhere
