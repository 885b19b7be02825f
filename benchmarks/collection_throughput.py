"""Environment steps per second through gymflow's rollout path against a plain in-process loop.

    .venv/bin/python benchmarks/collection_throughput.py --workers 2 --envs 8 --steps 128 --rounds 40
    .venv/bin/python benchmarks/collection_throughput.py --preset breakout-ppo --envs 4 --steps 128 --rounds 20

Baseline: a plain process (spawned for it, nothing else running in it) steps a SeededVectorEnv
of the preset's env (CartPole-v1 by default; for breakout-ppo, ALE Breakout with Atari's
preprocessing and 4 stacked frames) with the same batched PPO policy (`agents.rollout.collect`;
for pixels the Nature CNN), nothing written. gymflow: the same collection on a LocalCluster of
`--workers` processes, one job per worker per round, each loading its policy version from
storage, writing its shard and handing back a ShardRef (tasks/cluster/rounds.py's `run_round` through the
workers' job hosts, without the Prefect task around it).

This machine's per-core speed drifts by tens of percent within minutes, so the two sides are
interleaved round by round: one plain job's worth of collection (while the cluster idles), then
one gymflow round (while the plain process idles), and so on. A gymflow round does `--workers` jobs at once on as many cores, so the ratio per core is
(plain seconds per job) / (gymflow seconds per round); the target is >= 0.9.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import statistics
import tempfile
import time

import torch

from gymflow.presets.validate import resolve_experiment

LOGGER = logging.getLogger("benchmark")


def _plain_loop(connection, preset: str, envs: int, steps: int) -> None:
    """The baseline's process: on each request, collect one job's worth and answer its seconds."""
    from gymflow.agents.rollout import collect
    from gymflow.envs.vector import SeededVectorEnv
    from gymflow.presets.validate import resolve_experiment
    from gymflow.tasks.training.learning import create_learner

    torch.set_num_threads(1)
    experiment = resolve_experiment(preset)
    learner = create_learner(experiment)
    policy = experiment.algorithm.policy(learner.network, experiment.preset.agent, 0.0, 0)
    env_config = experiment.preset.env
    env = SeededVectorEnv(env_config.id, dict(env_config.kwargs), envs, seed=0, preprocessing=env_config.preprocessing())
    env.reset()
    collect(policy, env, steps)  # warm-up
    connection.send(0.0)
    while connection.recv():
        started = time.perf_counter()
        collect(policy, env, steps)
        connection.send(time.perf_counter() - started)


def interleaved(workers: int, envs: int, steps: int, rounds: int,
                preset: str = "cartpole-ppo") -> tuple[list[float], list[float]]:
    """(plain seconds per job, gymflow seconds per round), one pair per round, interleaved."""
    from gymflow.presets.validate import resolve_experiment
    from gymflow.tasks.cluster.client import dask_client, job_hosts
    from gymflow.tasks.cluster.jobs import run_rollout
    from gymflow.tasks.cluster.rounds import RoundPlan, run_round
    from gymflow.tasks.storage.objects import open_storage, storage_location
    from gymflow.tasks.training.learning import Checkpoints, create_learner

    here, there = multiprocessing.get_context("spawn").Pipe()
    baseline = multiprocessing.get_context("spawn").Process(target=_plain_loop, args=(there, preset, envs, steps),
                                                                daemon=True)
    baseline.start()
    here.recv()
    with tempfile.TemporaryDirectory() as folder:
        experiment = resolve_experiment(preset, {
            "storage.root": folder, "distribution.rollout_workers": workers,
            "distribution.envs_per_worker": envs, "schedule.rollout_steps_per_env": steps,
        })
        config = experiment.preset
        learner = create_learner(experiment)
        checkpoints = Checkpoints(open_storage(storage_location(config.storage)), "bench", config.storage,
                                  policy_window=10**6)
        for version in range(rounds + 1):
            checkpoints.publish(learner, version)
        plan = RoundPlan(config, "bench")
        plain, gymflow = [], []
        with dask_client(config.distribution) as client, job_hosts(client, config.distribution) as hosts:
            client.wait_for_workers(min(workers, os.cpu_count() or 1))
            first = plan.rollouts(0, 0.0, [None] * workers)
            resume_from = [ref.key for ref in run_round(hosts, run_rollout, first, LOGGER)]  # warm-up
            for version in range(1, rounds + 1):
                here.send(True)
                plain.append(here.recv())
                specs = plan.rollouts(version, 0.0, resume_from)
                started = time.perf_counter()
                resume_from = [ref.key for ref in run_round(hosts, run_rollout, specs, LOGGER)]
                gymflow.append(time.perf_counter() - started)
    here.send(False)
    baseline.join()
    return plain, gymflow


def gymflow_throughput(workers: int, envs: int, steps: int, rounds: int) -> tuple[float, float]:
    """(env steps per second, seconds per round) of gymflow's rollout rounds (benchmarks/scaling.py)."""
    _, rounds_seconds = interleaved(workers, envs, steps, rounds)
    seconds = statistics.median(rounds_seconds)
    return steps * envs * workers / seconds, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=128, help="steps per env per round")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--preset", default="cartpole-ppo", help="a PPO preset: its env, wrappers and policy")
    args = parser.parse_args()
    plain, gymflow = interleaved(args.workers, args.envs, args.steps, args.rounds, args.preset)
    job_steps = args.envs * args.steps
    cores = min(args.workers, os.cpu_count() or 1)
    ratio = statistics.median(p / g for p, g in zip(plain, gymflow)) * args.workers / cores
    print(f"machine: {os.cpu_count()} cores; {args.preset}, {args.envs} envs x {args.steps} steps per job, "
          f"{args.rounds} rounds interleaved, medians")
    print(f"plain loop, 1 process:                 {job_steps / statistics.median(plain):>10,.0f} env steps/s "
          f"({1000 * statistics.median(plain):.1f} ms a job)")
    print(f"gymflow, {args.workers} Dask worker processes: {job_steps * args.workers / statistics.median(gymflow):>10,.0f} env steps/s "
          f"({1000 * statistics.median(gymflow):.1f} ms a round of {args.workers} jobs)")
    print(f"ratio per core: {ratio:.2f} (target >= 0.9)")
    if args.preset != "cartpole-ppo":
        frame_skip = 4 if resolve_experiment(args.preset).preset.env.atari else 1
        print(f"frames/s per core (x{frame_skip} frame skip): plain {frame_skip * job_steps / statistics.median(plain):,.0f}, "
              f"gymflow {frame_skip * job_steps * args.workers / cores / statistics.median(gymflow):,.0f}")


if __name__ == "__main__":
    main()
