"""Where a run's jobs run: with `distribution.mode: single`, rollouts in the flow's process and
evaluations in one helper process beside it; otherwise on the job hosts of its Dask cluster
(tasks/cluster/client.py, imported only then: Dask is a third of a second of a single run's
start-up)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from gymflow.commands import gymflow_command
from gymflow.logs import AnyLogger
from gymflow.presets.model import Preset
from gymflow.presets.validate import Experiment
from gymflow.tasks.cluster.helper import HelperProcess
from gymflow.tasks.cluster.hosts import Hosts, InProcessHosts
from gymflow.tasks.storage.checkpoints import policies_kept_in_process
from gymflow.tasks.storage.objects import open_storage, storage_location


@contextmanager
def rollout_hosts(experiment: Experiment, logger: AnyLogger, run_id: str) -> Iterator[tuple[Hosts, str]]:
    """Where run `run_id`'s jobs run, and a few words saying where: the job hosts on its Dask
    cluster (`dask_client`, `job_hosts`), or, with `distribution.mode: single`, this process."""
    config = experiment.preset.distribution
    if config.mode == "single":
        helper = HelperProcess(instead=InProcessHosts())
        try:
            with (
                policies_kept_in_process(),  # the rollouts here act with what the learner here publishes
                open_storage(storage_location(experiment.preset.storage)).writing_behind(),  # shards and
            ):  # policies written off the loop's thread
                yield InProcessHosts(evaluations=helper), "single mode: rollouts in this process, evaluations beside it"
        finally:
            helper.close()
        return
    if (note := workers_beyond_cores(experiment.preset, os.cpu_count() or 1)) is not None:
        logger.warning("%s", note)
    if (note := plain_tcp_cluster(experiment.preset)) is not None:
        logger.warning("%s", note)
    from gymflow.tasks.cluster.client import dask_client, job_hosts  # Dask: imported by the runs that use it

    resume_hint = f"`{gymflow_command()} resume {run_id} --root {experiment.preset.storage.root}` continues the run"
    with dask_client(config, logger) as client, job_hosts(client, experiment, logger, resume_hint) as hosts:
        yield hosts, f"Dask dashboard {client.dashboard_link}"


def workers_beyond_cores(preset: Preset, cores: int) -> str | None:
    """One line for a run whose LocalCluster would have more rollout workers than the machine has
    cores: it starts one worker process a core, and the rest of a round's rollouts queue behind
    them (measured: 0.73 of linear speed-up, docs/benchmarks.md)."""
    workers = preset.distribution.rollout_workers
    if preset.remote_cluster or workers <= cores:
        return None
    return (f"distribution.rollout_workers: {workers} rollout workers do not fit this machine's {cores} cores; "
            f"its LocalCluster starts {cores} worker processes and the other rollouts of each round wait for them "
            f"(fewer workers with more distribution.envs_per_worker step as many envs with less waiting)")


def plain_tcp_cluster(preset: Preset) -> str | None:
    """One line for a run whose own cluster (a LocalCluster, SLURM's) was asked to speak plain tcp."""
    config = preset.distribution
    if config.cluster_tls or config.scheduler_address or config.cluster_class:
        return None
    return ("distribution.cluster_tls: false: the run's Dask cluster speaks plain tcp, so any process that reaches "
            "its scheduler's port can run code as this user")
