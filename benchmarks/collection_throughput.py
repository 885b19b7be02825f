"""Environment steps per second through gymflow's rollout path against a plain in-process loop.

    .venv/bin/python benchmarks/collection_throughput.py --workers 2 --envs 8 --steps 128 --rounds 40
    .venv/bin/python benchmarks/collection_throughput.py --preset breakout-ppo --envs 4 --steps 128 --rounds 20

Baseline: a plain process (spawned for it, nothing else running in it, one torch thread: one
core, as a worker) steps a SeededVectorEnv of the preset's env (CartPole-v1 by default; for
breakout-ppo, ALE Breakout with Atari's preprocessing and 4 stacked frames) with the same
batched PPO policy (`agents.rollout.collect`; for pixels the Nature CNN), nothing written. It
plays every worker's episodes step for step (one env per worker, with that worker's env seed,
and each round the same policy seeds and weights), so both sides do the same stepping: an Atari
job's time varies by tens of percent with how many games end in it. gymflow: the same
collection on a LocalCluster of `--workers` processes, one job per worker per round, each
loading its policy version from storage, writing its shard and handing back a ShardRef
(tasks/cluster/rounds.py's `run_round` through the workers' job hosts, without the Prefect task
around it).

This machine's per-core speed drifts by tens of percent within minutes, so the two sides are
interleaved round by round: one round's worth of plain collection, the workers' shares one
after another (while the cluster idles), then one gymflow round (while the plain process
idles), and so on. A gymflow round does `--workers` jobs at once on min(workers, cores) cores,
so the ratio per core is (plain seconds for the round's work) / (gymflow seconds per round x
cores used); the target is >= 0.9. A round waits for its slowest job, so the ratio counts that
too.

With `--plain-at-once` the baseline is instead one plain process per worker, all stepping their
shares at the same moment (its round lasts as long as the slowest): the same work on as many
busy cores, so what the ratio leaves out is what this VM loses when its cores work together.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import torch

from gymflow.presets.validate import resolve_experiment

LOGGER = logging.getLogger("benchmark")


def _plain_loop(connection, preset: str) -> None:
    """The baseline's process: on each request (a round's specs), collect each job's share as
    that job does, one after another, and answer the seconds and the episode returns."""
    from gymflow.agents.rollout import collect
    from gymflow.envs.vector import SeededVectorEnv
    from gymflow.tasks.training.learning import create_learner

    experiment = resolve_experiment(preset)  # the learner's initial weights: every published version's
    learner = create_learner(experiment)
    torch.set_num_threads(1)  # after the learner, which takes the preset's learner_threads
    envs: dict[int, SeededVectorEnv] = {}
    while specs := connection.recv():
        seconds, returns = 0.0, []
        for spec in specs:
            if spec.worker not in envs:
                envs[spec.worker] = SeededVectorEnv(spec.env_id, spec.env_kwargs, spec.num_envs, spec.env_seed,
                                                    spec.preprocessing)
                envs[spec.worker].reset()
            policy = experiment.algorithm.policy(learner.network, spec.agent, spec.exploration, spec.policy_seed)
            started = time.perf_counter()
            _, episodes = collect(policy, envs[spec.worker], spec.steps_per_env)
            seconds += time.perf_counter() - started
            returns.append(tuple(float(x) for x in episodes.returns))
        connection.send((seconds, returns))


@dataclass
class Timings:
    """Seconds per round, one entry per round."""

    plain: list[float] = field(default_factory=list)  # the round's work in the plain process
    gymflow: list[float] = field(default_factory=list)  # a gymflow round
    inside: list[float] = field(default_factory=list)  # the round's longest collection inside its jobs


def interleaved(workers: int, envs: int, steps: int, rounds: int, preset: str = "cartpole-ppo",
                baseline: bool = True, at_once: bool = False) -> Timings:
    """Plain and gymflow rounds alternated (gymflow's alone without `baseline`; the baseline as one
    process per worker, stepping at the same moment, with `at_once`)."""
    from gymflow.tasks.cluster.client import dask_client, job_hosts
    from gymflow.tasks.cluster.jobs import run_rollout
    from gymflow.tasks.cluster.rounds import RoundPlan, run_round
    from gymflow.tasks.storage.objects import open_storage, storage_location
    from gymflow.tasks.training.commits import Commits
    from gymflow.tasks.training.learning import create_learner

    timings = Timings()
    plain = _PlainProcesses(preset, workers if at_once else 1 if baseline else 0)
    with tempfile.TemporaryDirectory() as folder:
        experiment = resolve_experiment(preset, {
            "storage.root": folder, "distribution.rollout_workers": workers,
            "distribution.envs_per_worker": envs, "schedule.rollout_steps_per_env": steps,
        })
        config = experiment.preset
        checkpoints = Commits(open_storage(storage_location(config.storage)), "bench", config.storage,
                                  policy_window=10**6)
        learner = create_learner(experiment)
        for version in range(rounds + 1):
            checkpoints.publish(learner, version)
        plan = RoundPlan(config, "bench")
        with dask_client(config.distribution) as client, job_hosts(client, experiment, LOGGER) as hosts:
            client.wait_for_workers(min(workers, os.cpu_count() or 1))
            resume_from: list[str | None] = [None] * workers
            for version in range(rounds + 1):  # round 0 warms both sides up
                specs = plan.rollouts(version, 0.0, resume_from)
                plain_seconds, plain_returns = plain.collect(specs)
                started = time.perf_counter()
                refs = run_round(hosts, run_rollout, specs, LOGGER)
                seconds = time.perf_counter() - started
                resume_from = [ref.key for ref in refs]
                if baseline:
                    assert plain_returns == [ref.episode_returns for ref in refs], "the two sides played other episodes"
                if version:
                    timings.gymflow.append(seconds)
                    timings.inside.append(max(ref.collect_seconds for ref in refs))
                    timings.plain.append(plain_seconds)
    plain.close()
    return timings


class _PlainProcesses:
    """The baseline's processes: one does a round's jobs one after another; several (one per
    job) do them at the same moment, and the round lasts as long as the slowest."""

    def __init__(self, preset: str, count: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.pipes = [context.Pipe() for _ in range(count)]
        self.processes = [context.Process(target=_plain_loop, args=(there, preset), daemon=True)
                          for _, there in self.pipes]
        for process in self.processes:
            process.start()

    def collect(self, specs: list) -> tuple[float, list]:
        if not self.pipes:
            return float("nan"), []
        if len(self.pipes) == 1:
            self.pipes[0][0].send(specs)
            return self.pipes[0][0].recv()
        for (here, _), spec in zip(self.pipes, specs):
            here.send([spec])
        answers = [here.recv() for here, _ in self.pipes]
        return max(seconds for seconds, _ in answers), [returns[0] for _, returns in answers]

    def close(self) -> None:
        for (here, _), process in zip(self.pipes, self.processes):
            here.send(None)
            process.join()


def gymflow_throughput(workers: int, envs: int, steps: int, rounds: int) -> tuple[float, float]:
    """(env steps per second, seconds per round) of gymflow's rollout rounds (benchmarks/scaling.py)."""
    seconds = statistics.median(interleaved(workers, envs, steps, rounds, baseline=False).gymflow)
    return steps * envs * workers / seconds, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=128, help="steps per env per round")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--preset", default="cartpole-ppo", help="a PPO preset: its env, wrappers and policy")
    parser.add_argument("--plain-at-once", action="store_true",
                        help="the baseline as one plain process per worker, stepping at the same moment")
    args = parser.parse_args()
    timings = interleaved(args.workers, args.envs, args.steps, args.rounds, args.preset, at_once=args.plain_at_once)
    round_steps = args.envs * args.steps * args.workers
    cores = min(args.workers, os.cpu_count() or 1)
    plain, gymflow = statistics.median(timings.plain), statistics.median(timings.gymflow)
    plain_cores = cores if args.plain_at_once else 1
    ratio = statistics.median(p * plain_cores / (g * cores) for p, g in zip(timings.plain, timings.gymflow))
    print(f"machine: {os.cpu_count()} cores; {args.preset}, {args.envs} envs x {args.steps} steps per job, "
          f"{args.rounds} rounds interleaved, medians")
    if args.plain_at_once:
        print(f"plain loop, {args.workers} processes at once:   {round_steps / plain:>10,.0f} env steps/s "
              f"({1000 * plain:.1f} ms a round of {args.workers} jobs)")
    else:
        print(f"plain loop, 1 process:                 {round_steps / plain:>10,.0f} env steps/s "
              f"({1000 * plain / args.workers:.1f} ms a job)")
    print(f"gymflow, {args.workers} Dask worker processes: {round_steps / gymflow:>10,.0f} env steps/s "
          f"({1000 * gymflow:.1f} ms a round of {args.workers} jobs on {cores} cores)")
    print(f"  of which collecting inside the jobs (the slowest): {1000 * statistics.median(timings.inside):.1f} ms; "
          f"the rest (policy load, shard write, Dask): "
          f"{1000 * statistics.median(g - c for g, c in zip(timings.gymflow, timings.inside)):.1f} ms")
    print(f"ratio per core: {ratio:.2f} (target >= 0.9)")
    if args.preset != "cartpole-ppo":
        frame_skip = 4 if resolve_experiment(args.preset).preset.env.atari else 1
        print(f"frames/s per core (x{frame_skip} frame skip): plain {frame_skip * round_steps / plain_cores / plain:,.0f}, "
              f"gymflow {frame_skip * round_steps / cores / gymflow:,.0f}")


if __name__ == "__main__":
    main()
