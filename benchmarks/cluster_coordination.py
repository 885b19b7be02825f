"""What a SYNC round costs beyond its jobs' work, with 1 to 64 Dask worker processes.

    .venv/bin/python benchmarks/cluster_coordination.py --workers 1 4 16 64 --rounds 5

For each N: a `dask scheduler` process and N worker processes (one thread each; their nannies in
one "farm" process, the workers forked from a server that has imported torch and gymflow's jobs,
as gymflow's LocalCluster does), reached as a remote cluster is: through the scheduler. The
flow's side is this process: each round publishes a policy version (as the learner commits),
runs one rollout job per worker through the job hosts (tasks/cluster/hosts.py, `run_round`),
and reads every shard back (as the learner ingests them). A job is 1,000 steps of CartPole-v1
with cartpole-ppo's policy on one env: cheap stepping, so what grows with N is coordination.

Printed per N (medians over the rounds after a warm-up round):
- round: the round's wall-clock, publish + jobs + shard reads;
- jobs' CPU / cores: the CPU time the N jobs spent (each measured in its own thread: stepping,
  policy load, shard write) over the cores they shared; with more processes than cores, jobs
  share cores and their wall-clock says little;
- coordination: round minus jobs' CPU / cores: actor calls, the scheduler's routing, waiting for
  the slowest, the flow's publish and shard reads; and its share of the round (target < 10% at 64);
- flow: the flow's own time publishing and reading shards;
- the CPU time a round costs outside the jobs: this process's (flow CPU), the scheduler's, and the
  worker processes' beyond their jobs plus their nannies' (event loops, heartbeats, the actor calls);
- idle worker CPU: a worker process's CPU per second (with its nanny's) while no job runs, over 3 s
  after the rounds: Dask's own background work (heartbeats, memory and system monitors);
- policy reads per round on the workers (reads of policy.safetensors from storage, summed over the
  worker processes): one per machine (tasks/storage/blob_cache.py), not one per process or job
  (`--jobs-per-worker 4` sends each process 4 jobs a round; `--no-node-cache` turns the machine's
  cache off: one read per process).

Not in these figures (per round, not per worker): the Prefect task run and MLflow metrics of a
round, measured by benchmarks/orchestration_overhead.py. This machine has 2 cores: with 64
processes, everything here (the farm, the scheduler, this process) shares them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

LOGGER = logging.getLogger("cluster_coordination")
DASK = str(Path(sys.executable).with_name("dask"))
IDLE_S = 3.0


@dataclass(frozen=True)
class TimedJob:
    ref: object
    cpu_seconds: float


def timed_rollout(spec) -> TimedJob:
    """run_rollout, with the CPU time of its thread (the job's own compute, wherever it is scheduled)."""
    from gymflow.tasks.cluster.jobs import run_rollout

    started = time.thread_time()
    ref = run_rollout(spec)
    return TimedJob(ref, time.thread_time() - started)


def worker_policy_reads(location) -> int:
    """policy.safetensors reads by this worker process so far, from the run's storage."""
    from gymflow.tasks.storage.objects import open_storage

    return open_storage(location).reads["policies/policy.safetensors"]


class Trained:
    """The learner's weights moved a little at each version, as training moves them: every
    published version is a new blob (the same weights would be one blob, by sha256)."""

    def __init__(self, learner) -> None:
        self.learner, self.version = learner, 0

    def at(self, version: int) -> Trained:
        self.version = version
        return self

    def policy_weights(self) -> dict:
        return {name: tensor + 1e-6 * self.version for name, tensor in self.learner.policy_weights().items()}


def farm(address: str, workers: int) -> None:
    """N nannies in this process, their workers forked from a server with gymflow's jobs imported."""
    import dask
    from distributed import Nanny

    from gymflow.tasks.cluster import client as cluster

    cluster._workers_forked_with_jobs_imported()

    async def serve() -> None:
        nannies = [Nanny(address, nthreads=1, memory_limit=0, host="127.0.0.1", dashboard=False)
                   for _ in range(workers)]
        await asyncio.gather(*nannies)
        await asyncio.Event().wait()

    with dask.config.set(cluster.WORKER_CONFIG):
        asyncio.run(serve())


@dataclass
class Point:
    workers: int
    rounds: list[float]
    jobs_cpu: list[float]
    flow: list[float]
    scheduler_cpu: list[float]
    flow_cpu: list[float]  # this process's CPU time
    workers_other_cpu: list[float]  # the worker processes' CPU beyond their jobs (event loops, heartbeats) and the nannies'
    policy_reads: list[int]
    start_seconds: float
    streamed: dict[str, float] | None = None  # the ASYNC phase's figures, with --async-chunks
    idle_cpu_per_worker_s: float = 0.0  # a worker process's (and its nanny's) CPU per second while no job runs


def measure(workers: int, rounds: int, steps: int, jobs_per_worker: int = 1, async_chunks: int = 0) -> Point:
    from distributed import Client

    from gymflow.presets.validate import resolve_experiment
    from gymflow.tasks.cluster.hosts import HostPool
    from gymflow.tasks.cluster.rounds import RoundPlan, run_round
    from gymflow.tasks.storage.objects import open_storage, storage_location
    from gymflow.tasks.storage.shards import read_shard
    from gymflow.tasks.training.commits import Commits
    from gymflow.tasks.training.learning import create_learner

    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    scheduler = subprocess.Popen([DASK, "scheduler", "--host", "127.0.0.1", "--port", str(port),
                                  "--dashboard-address", "127.0.0.1:0"], **quiet)
    started = time.perf_counter()
    if os.environ.get("GYMFLOW_BLOB_CACHE") != "off":  # the workers' machine cache, fresh for each N
        os.environ["GYMFLOW_BLOB_CACHE"] = tempfile.mkdtemp(prefix="gymflow-bench-blobs-")
    workers_farm = subprocess.Popen([sys.executable, __file__, "--farm", address, str(workers)], **quiet)
    try:
        with tempfile.TemporaryDirectory() as folder, Client(address, timeout=60) as client:
            client.wait_for_workers(workers, timeout=900)
            start_seconds = time.perf_counter() - started
            experiment = resolve_experiment("cartpole-ppo", {
                "storage.root": folder, "storage.shared": True, "distribution.scheduler_address": address,
                "distribution.rollout_workers": workers * jobs_per_worker, "distribution.envs_per_worker": 1,
                "schedule.rollout_steps_per_env": steps})
            preset = experiment.preset
            storage = open_storage(storage_location(preset.storage))
            checkpoints = Commits(storage, "bench", preset.storage, policy_window=10**6)
            learner, plan = Trained(create_learner(experiment)), RoundPlan(preset, "bench")
            hosts = HostPool(client, {}, 600)
            hosts.start(workers * jobs_per_worker)
            point = Point(workers, [], [], [], [], [], [], [], start_seconds)
            scheduler_process, cursors = psutil.Process(scheduler.pid), [None] * (workers * jobs_per_worker)
            farm_processes = [psutil.Process(workers_farm.pid), *psutil.Process(workers_farm.pid).children(recursive=True)]
            for version in range(rounds + 1):  # round 0 warms up: hosts, envs, first policy
                cpu_before = sum(scheduler_process.cpu_times()[:2])
                farm_before, flow_before = _cpu(farm_processes), time.process_time()
                reads_before = sum(client.run(worker_policy_reads, storage.location).values())
                began = time.perf_counter()
                checkpoints.publish(learner.at(version), version)
                published = time.perf_counter()
                jobs = run_round(hosts, timed_rollout, plan.rollouts(version, 0.0, cursors), LOGGER)
                collected = time.perf_counter()
                for job in jobs:
                    read_shard(storage, job.ref)
                ended = time.perf_counter()
                farm_cpu, flow_cpu = _cpu(farm_processes) - farm_before, time.process_time() - flow_before
                cursors = [job.ref.key for job in jobs]
                if version:
                    point.rounds.append(ended - began)
                    point.jobs_cpu.append(sum(job.cpu_seconds for job in jobs) / min(workers, os.cpu_count() or 1))
                    point.flow.append((published - began) + (ended - collected))
                    point.scheduler_cpu.append(sum(scheduler_process.cpu_times()[:2]) - cpu_before)
                    point.flow_cpu.append(flow_cpu)
                    point.workers_other_cpu.append(farm_cpu - sum(job.cpu_seconds for job in jobs))
                    point.policy_reads.append(sum(client.run(worker_policy_reads, storage.location).values()) - reads_before)
            idle_before, idle_began = _cpu(farm_processes), time.perf_counter()
            time.sleep(IDLE_S)
            point.idle_cpu_per_worker_s = (_cpu(farm_processes) - idle_before) / (time.perf_counter() - idle_began) / workers
            if async_chunks:
                cpu = (lambda: sum(scheduler_process.cpu_times()[:2]), lambda: _cpu(farm_processes), time.process_time)
                point.streamed = stream(hosts, plan, checkpoints, learner, cursors[:workers], async_chunks, cpu,
                                        lambda: sum(client.run(worker_policy_reads, storage.location).values()),
                                        rounds + 1)
            hosts.close()
            return point
    finally:
        for process in (workers_farm, scheduler):
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()


def stream(hosts, plan, checkpoints, learner, cursors: list, chunks: int, cpu: tuple, policy_reads,
           first_version: int) -> dict[str, float]:
    """ASYNC: every worker collects `chunks` chunks, each sent as soon as its previous one is back,
    acting with the newest version; the flow reads each shard as it lands and publishes a new
    version every `workers` chunks (as a learner commits while shards stream in)."""
    from gymflow.tasks.cluster.hosts import wait_first
    from gymflow.tasks.storage.shards import read_shard

    workers, storage = len(cursors), checkpoints.storage
    version = checkpoints_published = first_version
    checkpoints.publish(learner.at(version), version)
    before = [measure() for measure in cpu]
    reads_before, jobs_cpu, landed, sent = policy_reads(), 0.0, 0, [1] * workers
    began = time.perf_counter()
    in_flight = {w: hosts.call(timed_rollout, plan.chunk(w, 0, 0.0, cursors[w]), slot=w) for w in range(workers)}
    while in_flight:
        wait_first(in_flight.values(), 600)
        for worker, call in list(in_flight.items()):
            call = in_flight[worker] = hosts.settle(call, LOGGER)
            if not call.finished:
                continue
            job = call.future.result()
            read_shard(storage, job.ref)
            jobs_cpu, landed = jobs_cpu + job.cpu_seconds, landed + 1
            if landed % workers == 0:
                checkpoints_published += 1
                checkpoints.publish(learner.at(checkpoints_published), checkpoints_published)
            if sent[worker] < chunks:
                in_flight[worker] = hosts.call(timed_rollout, plan.chunk(worker, sent[worker], 0.0, job.ref.key),
                                               slot=worker)
                sent[worker] += 1
            else:
                del in_flight[worker]
    wall = time.perf_counter() - began
    scheduler_cpu, farm_cpu, flow_cpu = (measure() - start for measure, start in zip(cpu, before))
    cores = min(workers, os.cpu_count() or 1)
    return {"chunks": landed, "wall": wall, "jobs_cpu_per_core": jobs_cpu / cores, "flow_cpu": flow_cpu,
            "scheduler_cpu": scheduler_cpu, "workers_other_cpu": farm_cpu - jobs_cpu,
            "policy_reads": policy_reads() - reads_before, "versions": checkpoints_published - version}


def _cpu(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            total += sum(process.cpu_times()[:2])
        except psutil.Error:
            pass
    return total


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    if sys.argv[1:2] == ["--farm"]:
        farm(sys.argv[2], int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1000, help="env steps per job")
    parser.add_argument("--jobs-per-worker", type=int, default=1, help="rollout jobs per worker process a round")
    parser.add_argument("--no-node-cache", action="store_true", help="GYMFLOW_BLOB_CACHE=off for the workers")
    parser.add_argument("--async-chunks", type=int, default=0, help="then an ASYNC phase of this many chunks a worker")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ["GYMFLOW_BLOB_CACHE"] = "off" if args.no_node_cache else ""
    points = [measure(workers, args.rounds, args.steps, args.jobs_per_worker, args.async_chunks)
              for workers in args.workers]
    median = statistics.median
    print(f"\nmachine: {os.cpu_count()} cores; CartPole-v1, 1 env x {args.steps} steps per job, "
          f"{args.jobs_per_worker} job(s) per worker, "
          f"{args.rounds} rounds after a warm-up, medians")
    print(f"{'workers':>7} {'start s':>7} {'round ms':>9} {'jobs CPU/cores ms':>17} {'coordination ms':>15} "
          f"{'share':>6} {'flow ms':>8} {'flow CPU ms':>11} {'scheduler CPU ms':>16} {'workers other CPU ms':>20} "
          f"{'policy reads':>12} {'idle worker CPU ms/s':>20}")
    for point in points:
        coordination = median(r - c for r, c in zip(point.rounds, point.jobs_cpu))
        print(f"{point.workers:>7} {point.start_seconds:>7.0f} {1000 * median(point.rounds):>9.0f} "
              f"{1000 * median(point.jobs_cpu):>17.0f} {1000 * coordination:>15.0f} "
              f"{coordination / median(point.rounds):>6.1%} {1000 * median(point.flow):>8.0f} "
              f"{1000 * median(point.flow_cpu):>11.0f} {1000 * median(point.scheduler_cpu):>16.0f} "
              f"{1000 * median(point.workers_other_cpu):>20.0f} {median(point.policy_reads):>12.0f} "
              f"{1000 * point.idle_cpu_per_worker_s:>20.1f}")
    if args.async_chunks:
        print_streamed(points, args.steps)


def print_streamed(points: list[Point], steps: int) -> None:
    print(f"\nASYNC: every worker's chunks back to back (1 env x {steps} steps each), newest policy, a version "
          "published every N chunks; totals over the phase")
    print(f"{'workers':>7} {'chunks':>6} {'wall ms':>8} {'jobs CPU/cores ms':>17} {'coordination':>12} "
          f"{'flow CPU ms/chunk':>17} {'scheduler CPU ms/chunk':>22} {'workers other CPU ms/chunk':>26} "
          f"{'policy reads':>12} {'versions':>8}")
    for point in points:
        f = point.streamed
        print(f"{point.workers:>7} {f['chunks']:>6.0f} {1000 * f['wall']:>8.0f} {1000 * f['jobs_cpu_per_core']:>17.0f} "
              f"{1 - f['jobs_cpu_per_core'] / f['wall']:>12.1%} {1000 * f['flow_cpu'] / f['chunks']:>17.2f} "
              f"{1000 * f['scheduler_cpu'] / f['chunks']:>22.2f} {1000 * f['workers_other_cpu'] / f['chunks']:>26.2f} "
              f"{f['policy_reads']:>12.0f} {f['versions']:>8.0f}")


if __name__ == "__main__":
    main()
