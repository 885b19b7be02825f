"""`distribution.mode: single`: the jobs run in the flow's own process, no Dask cluster, and the
run is the same as a SYNC run, byte for byte."""

from __future__ import annotations

import copy
import os
import subprocess
import threading

import numpy as np
import psutil
import pytest
import torch

from gymflow.agents import rollout as rollout_module
from gymflow.agents.rollout import collect, collect_together
from gymflow.envs.vector import SeededVectorEnv
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
    """The command lines of the processes this one starts while inside (the last each showed), looked at every 20 ms."""

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
                if child.pid in self.before:
                    continue
                try:  # looked at again each time: between its fork and its exec a child has this process's command line
                    command = " ".join(child.cmdline())
                except psutil.Error:
                    command = ""
                if command or child.pid not in self.seen:  # a child on its way out shows none: the last one stays
                    self.seen[child.pid] = command or "(gone before it was looked at)"


def _popened(monkeypatch) -> list[tuple[int, str]]:
    """(pid, command line) of each process `subprocess.Popen` starts from now on in this process."""
    popened: list[tuple[int, str]] = []

    class Recorded(subprocess.Popen):
        def __init__(self, args, *rest, **options) -> None:
            super().__init__(args, *rest, **options)
            popened.append((self.pid, " ".join(map(str, args)) if isinstance(args, list | tuple) else str(args)))

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    return popened


def _final_policy(root, summary) -> bytes:
    return read_policy(Storage(StorageLocation(str(root))), RunLayout(summary.run_id),
                       summary.versions_committed - 1, [POLICY_BLOB])[POLICY_BLOB]


@pytest.mark.parametrize("preset, extra", [
    ("cartpole-ppo", {}),
    pytest.param("cartpole-dqn", DQN, marks=pytest.mark.slow),  # long tier: single mode is one loop for every algorithm
])
def test_a_single_run_starts_no_process_and_ends_byte_identical_to_a_sync_run(prefect_api, workspace, tiny_budget,
                                                                              preset, extra, monkeypatch):
    run = {**tiny_budget, **local_overrides(workspace), **extra}
    synced = improve(preset, {**run, "storage.root": str(workspace / "sync")})
    popened = _popened(monkeypatch)
    with NewProcesses() as started:
        single = improve(preset, {**run, "storage.root": str(workspace / "single"), "distribution.mode": "single"})
    # no Dask worker, nanny or fork server (MLflow's model logging runs a Python of its own); the one
    # helper process that evaluated beside the learner has ended with the run (counted as it is started:
    # a watch every 20 ms can miss a short-lived process on a loaded machine)
    assert not [command for command in started.seen.values() if "multiprocessing" in command or "dask" in command], \
        started.seen
    helpers = [pid for pid, command in popened if "gymflow.tasks.cluster.helper" in command]
    assert len(helpers) == 1 and not psutil.pid_exists(helpers[0]), (popened, started.seen)
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


def _acting_policies(preset: str, jobs: int, exploration: float) -> tuple[list, list]:
    """Two sets of `jobs` policies of one preset's first version, each set acting from one network
    (the same weights), each policy with its own seed, as a round's rollouts in one process act."""
    experiment = resolve_experiment(preset)
    algorithm, agent = experiment.algorithm, experiment.preset.agent
    with torch.random.fork_rng():  # the same weights whichever tests ran before in this process
        torch.manual_seed(0)
        network = algorithm.network(agent, experiment.observation_space, experiment.action_space)
    return tuple([algorithm.policy(net, agent, exploration, seed) for seed in range(jobs)]
                 for net in (network, copy.deepcopy(network)))


def _envs(jobs: int, each: int) -> list[SeededVectorEnv]:
    envs = [SeededVectorEnv("CartPole-v1", {}, each, seed=job) for job in range(jobs)]
    for env in envs:
        env.reset()
    return envs


def _same(a, b) -> bool:
    return all(x is None and y is None or np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(a, b))


@pytest.mark.parametrize("preset, exploration", [("cartpole-ppo", 0.0), ("cartpole-dqn", 0.3)])
def test_rollouts_stepped_together_run_the_network_once_a_step_and_collect_what_each_alone_does(
        preset, exploration, monkeypatch):
    rows_seen = []
    policies, alone = _acting_policies(preset, 3, exploration)
    monkeypatch.setattr(rollout_module, "_ROWS_ALIKE", {})  # this machine's kernels are checked again
    forward = type(policies[0]).outputs
    monkeypatch.setattr(type(policies[0]), "outputs", lambda policy, obs: rows_seen.append(len(obs)) or
                        forward(policy, obs))
    together = collect_together(policies, _envs(3, 4), 40)
    seen_together = list(rows_seen)
    apart = [collect(policy, env, 40) for policy, env in zip(alone, _envs(3, 4))]
    for (rollout, episodes), (rollout_alone, episodes_alone) in zip(together, apart, strict=True):
        assert _same(rollout, rollout_alone) and _same(episodes, episodes_alone)
        assert len(episodes_alone.returns) > 0  # episodes ended, and their ends were recorded alike
    (alike,) = rollout_module._ROWS_ALIKE.values()  # this machine's kernels: a row's bits the same in a bigger batch
    # checked once against each batch alone, then one forward a step (or, rows not alike, each batch's own)
    assert seen_together == [12, 4, 4, 4] + ([12] * 39 if alike else [4, 4, 4] * 39)


def test_rollouts_whose_batched_rows_come_out_other_than_alone_are_acted_on_apart(monkeypatch):
    """A machine whose kernels give a row other bits in a bigger batch (not this one: faked by an
    actor whose logits are scaled by the batch's size) gets each batch's own forward."""
    policies, alone = _acting_policies("cartpole-ppo", 2, 0.0)
    network = type(policies[0].network)
    honest = network.action_output
    monkeypatch.setattr(network, "action_output", lambda self, obs: honest(self, obs) * (1 + 0.01 * len(obs)))
    monkeypatch.setattr(rollout_module, "_ROWS_ALIKE", {})
    together = collect_together(policies, _envs(2, 8), 30)
    apart = [collect(policy, env, 30) for policy, env in zip(alone, _envs(2, 8))]
    assert all(_same(a[0], b[0]) for a, b in zip(together, apart, strict=True))
    assert list(rollout_module._ROWS_ALIKE.values()) == [False]
