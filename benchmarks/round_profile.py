"""Where a SYNC round's time goes: the profile behind docs/benchmarks.md's overhead table.

    .venv/bin/python benchmarks/round_profile.py --preset cartpole-ppo --env-steps 40960

Prints (1) the round trip of two no-op jobs on a LocalCluster like the flow's, as Dask tasks and
through gymflow's job hosts (Dask actors, tasks/cluster/hosts.py), side by side, (2) one
rollout job in a bare process (its wall-clock against its env stepping), and (3) timers around
the improve loop's functions during a whole run of the preset (target off), against what the
rollout jobs reported as stepping time inside the cluster.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import tempfile
import time


def _noop(x):
    return x


def round_trips(repeats: int = 100) -> tuple[float, float]:
    """(Dask tasks, job hosts): median seconds to run two no-op jobs, one on each of two workers,
    and have both results back, on a LocalCluster like the flow's."""
    import logging

    from distributed import Client, LocalCluster

    from gymflow.tasks.cluster.hosts import HostPool
    from gymflow.tasks.cluster.rounds import run_round

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(2)
        workers = sorted(client.scheduler_info()["workers"])
        tasks, hosts = [], []
        pool = HostPool(client, None, 60)
        run_round(pool, _noop, [0, 1], logging.getLogger())  # starts the hosts
        for i in range(repeats):
            started = time.perf_counter()
            futures = [client.submit(_noop, i, workers=[w], allow_other_workers=True, pure=False) for w in workers]
            for future in futures:
                future.result()
            tasks.append(time.perf_counter() - started)
            started = time.perf_counter()
            run_round(pool, _noop, [i, i], logging.getLogger())
            hosts.append(time.perf_counter() - started)
        pool.close()
    return statistics.median(tasks), statistics.median(hosts)


def bare_rollout_job(preset: str, rounds: int = 30) -> tuple[float, float]:
    """(wall-clock, env-stepping seconds) of one rollout job run in this process."""
    from gymflow.presets.validate import resolve_experiment
    from gymflow.tasks.cluster.jobs import run_rollout
    from gymflow.tasks.cluster.rounds import RoundPlan
    from gymflow.tasks.storage.objects import open_storage, storage_location
    from gymflow.tasks.training.commits import Commits
    from gymflow.tasks.training.learning import create_learner

    with tempfile.TemporaryDirectory() as folder:
        experiment = resolve_experiment(preset, {"storage.root": folder})
        config, learner = experiment.preset, create_learner(experiment)
        checkpoints = Commits(open_storage(storage_location(config.storage)), "profile", config.storage,
                                  policy_window=10**6)
        workers = config.distribution.rollout_workers
        for version in range(rounds):
            checkpoints.publish(learner, version)
        resume_from: list[str | None] = [None] * workers
        walls, stepping = [], []
        for version in range(rounds):
            specs = RoundPlan(config, "profile").rollouts(version, 0.0, resume_from)
            started = time.perf_counter()
            refs = [run_rollout(spec) for spec in specs]
            walls.append((time.perf_counter() - started) / len(specs))
            stepping.append(statistics.mean(ref.collect_seconds for ref in refs))
            resume_from = [ref.key for ref in refs]
    return statistics.median(walls[2:]), statistics.median(stepping[2:])


def loop_phases(preset: str, env_steps: int) -> tuple[dict[str, list[float]], object]:
    from prefect.testing.utilities import prefect_test_harness

    from gymflow.flows.improve import improve
    from gymflow.presets.validate import resolve_experiment
    from gymflow.tasks.cluster import rounds
    from gymflow.tasks.training import collection, commits, learning, loop

    timers: dict[str, list[float]] = collections.defaultdict(list)

    def timed(owner, name: str, label: str) -> None:
        function = getattr(owner, name)

        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                timers[label].append(time.perf_counter() - started)

        setattr(owner, name, wrapper)

    timed(collection, "collect_round", "collect round")
    timed(rounds, "run_round", "  the round's jobs, sent and gathered")
    timed(loop, "learn", "learn (shard reads included)")
    timed(learning, "read_shard", "  shard read + sha256")
    timed(commits.Commits, "commit", "checkpoint commit")
    timed(resolve_experiment(preset).algorithm.parts().learner, "learn", "  the algorithm's learn()")
    with prefect_test_harness(server_startup_timeout=120), tempfile.TemporaryDirectory() as folder:
        overrides = {"schedule.total_env_steps": env_steps, "schedule.target_return": None,
                     "storage.root": os.path.join(folder, "data"),
                     "tracking.tracking_uri": f"sqlite:///{os.path.join(folder, 'mlflow.db')}"}
        improve(preset, {**overrides, "schedule.total_env_steps": 4096})  # warm-up
        timers.clear()
        summary = improve(preset, overrides)
    return timers, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="cartpole-ppo", help="a SYNC preset")
    parser.add_argument("--env-steps", type=int, default=40_960)
    args = parser.parse_args()
    task_trip, host_trip = round_trips()
    job_wall, job_stepping = bare_rollout_job(args.preset)
    timers, summary = loop_phases(args.preset, args.env_steps)
    print(f"\nmachine: {os.cpu_count()} cores")
    print(f"two no-op jobs on two workers, submitted and gathered (median of 100): as Dask tasks {1000 * task_trip:.1f} ms, "
          f"through job hosts {1000 * host_trip:.1f} ms, ratio {task_trip / host_trip:.1f}")
    print(f"one rollout job in a bare process: {1000 * job_wall:.1f} ms wall, {1000 * job_stepping:.1f} ms stepping envs")
    print(f"improve({args.preset!r}), {summary.env_steps:,} env steps: loop {summary.wall_seconds:.2f} s, "
          f"work {summary.work_seconds:.2f} s, orchestration share {100 * summary.orchestration_share:.1f}%")
    for label, values in timers.items():
        print(f"  {label:<45} x{len(values):<4} median {1000 * statistics.median(values):7.1f} ms, total {sum(values):6.2f} s")


if __name__ == "__main__":
    main()
