"""Environment steps per second through gymflow's rollout path against a plain in-process loop.

    .venv/bin/python benchmarks/collection_throughput.py --workers 2 --envs 8 --steps 128 --rounds 20 --repeats 3

Baseline: one process steps a SeededVectorEnv of CartPole-v1 with the same batched PPO policy
(`agents.rollout.collect`), nothing written. gymflow: the same collection as Dask jobs on a
LocalCluster of `--workers` processes, one job per worker per round, each loading its policy
version from storage, writing its shard, and handing back a ShardRef (tasks.rollout's round
logic through the workers' job hosts, without the Prefect task around it). Ratio per core = (gymflow steps/s / workers) /
baseline steps/s; the target is >= 0.9. With --repeats, baseline and gymflow alternate and the
medians are compared: this machine's per-core speed drifts by tens of percent within minutes.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time

import torch

LOGGER = logging.getLogger("benchmark")


def plain_throughput(envs: int, steps: int, rounds: int) -> float:
    """Env steps per second of one process collecting with the PPO policy, nothing written."""
    from agents.rollout import collect
    from envs.vector import SeededVectorEnv
    from presets.validate import resolve_experiment
    from tasks.learn import create_learner

    torch.set_num_threads(1)
    experiment = resolve_experiment("cartpole-ppo")
    learner = create_learner(experiment)
    policy = experiment.algorithm.policy(learner.network, experiment.preset.agent, 0.0, 0)
    env = SeededVectorEnv("CartPole-v1", {}, envs, seed=0)
    env.reset()
    collect(policy, env, steps)  # warm-up
    started = time.perf_counter()
    for _ in range(rounds):
        collect(policy, env, steps)
    return rounds * steps * envs / (time.perf_counter() - started)


def gymflow_throughput(workers: int, envs: int, steps: int, rounds: int) -> tuple[float, float]:
    """(env steps per second, seconds per round) of gymflow's rollout rounds on a LocalCluster of
    `workers` processes, shards written to a local folder."""
    from presets.validate import resolve_experiment
    from tasks.cluster import dask_client, job_hosts
    from tasks.jobs import run_rollout
    from tasks.learn import create_learner, save_checkpoint
    from tasks.rollout import run_round
    from tasks.rounds import rollout_round, storage_location

    with tempfile.TemporaryDirectory() as folder:
        experiment = resolve_experiment("cartpole-ppo", {
            "storage.root": folder, "distribution.rollout_workers": workers,
            "distribution.envs_per_worker": envs, "schedule.rollout_steps_per_env": steps,
        })
        config = experiment.preset
        learner = create_learner(experiment)
        for version in range(rounds + 1):
            save_checkpoint(storage_location(config), "bench", version, learner, {}, include_replay=False)
        with dask_client(config.distribution) as client, job_hosts(client, config.distribution) as hosts:
            client.wait_for_workers(min(workers, os.cpu_count() or 1))
            first = rollout_round(config, "bench", 0, 0.0, [None] * workers)
            resume_from = [ref.key for ref in run_round(hosts, run_rollout, first, LOGGER)]  # warm-up
            started = time.perf_counter()
            for version in range(1, rounds + 1):
                specs = rollout_round(config, "bench", version, 0.0, resume_from)
                resume_from = [ref.key for ref in run_round(hosts, run_rollout, specs, LOGGER)]
            seconds = time.perf_counter() - started
    return rounds * steps * envs * workers / seconds, seconds / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=128, help="steps per env per round")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=1, help="alternate baseline and gymflow this many times")
    args = parser.parse_args()
    baselines, gymflows, rounds = [], [], []
    for _ in range(args.repeats):
        baselines.append(plain_throughput(args.envs, args.steps, args.rounds))
        throughput, round_seconds = gymflow_throughput(args.workers, args.envs, args.steps, args.rounds)
        gymflows.append(throughput)
        rounds.append(round_seconds)
        print(f"  plain {baselines[-1]:,.0f} steps/s, gymflow {throughput:,.0f} steps/s")
    baseline, gymflow, round_seconds = (statistics.median(v) for v in (baselines, gymflows, rounds))
    print(f"machine: {os.cpu_count()} cores; CartPole-v1, {args.envs} envs x {args.steps} steps per job, "
          f"{args.rounds} rounds, medians of {args.repeats}")
    print(f"plain loop, 1 process:           {baseline:>10,.0f} env steps/s")
    print(f"gymflow, {args.workers} Dask worker processes: {gymflow:>10,.0f} env steps/s "
          f"({gymflow / args.workers:,.0f} per worker)")
    print(f"ratio per core: {gymflow / min(args.workers, os.cpu_count() or 1) / baseline:.2f} (target >= 0.9); "
          f"round wall-clock {1000 * round_seconds:.1f} ms")


if __name__ == "__main__":
    main()
