"""A host's cores as one rollout worker stepping its envs on as many C++ threads, against as many
worker processes of one thread each: gymflow's collection (the rollout job a Dask worker runs) in
env steps per second for the whole host, on a C++ backend.

    .venv/bin/python benchmarks/worker_shapes.py                       # Breakout on envpool and ale
    .venv/bin/python benchmarks/worker_shapes.py --task HalfCheetah --backends envpool --workers 4

- **N processes x 1 thread**: N processes, each collecting with `--envs` envs and one C++ thread.
- **1 process x N threads**: one process collecting with N x `--envs` envs and
  `distribution.env_threads` N.

N is `--workers` (default: the cores this process may use). Each side's processes make their envs
and collect once before a barrier, then collect for `--seconds`; the sides alternate round by
round (this VM's speed drifts), each figure the median over rounds. The last line:

    one process with N threads / N processes: R (backend), ...
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile

from env_backends import BACKENDS, gymflow_collection


def _collect(name: str, backend: str, envs: int, threads: int, seconds: float, folder: str, ready, figures) -> None:
    """One process's collection: warm, wait for the others, then `seconds` of rollout jobs."""
    collect = gymflow_collection(name, backend, envs, seconds, os.path.join(folder, str(os.getpid())), threads)
    collect()  # warm: imports, the envs made, the first shard's files
    ready.wait()
    figures.put(collect())


def host_collection(name: str, backend: str, processes: int, envs: int, threads: int, seconds: float,
                    folder: str) -> float:
    """Env steps per second of `processes` collecting side by side (each `envs` envs on `threads`)."""
    context = multiprocessing.get_context("spawn")
    ready, figures = context.Barrier(processes), context.Queue()
    started = [context.Process(target=_collect, args=(name, backend, envs, threads, seconds, folder, ready, figures))
               for _ in range(processes)]
    for process in started:
        process.start()
    total = sum(figures.get() for _ in started)
    for process in started:
        process.join()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="Breakout", choices=sorted(BACKENDS))
    parser.add_argument("--backends", nargs="+", default=None, help="default: those that have the task")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--envs", type=int, default=8, help="envs a worker process (a thread's share)")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    n = args.workers
    print(f"{args.task}, {n} cores' worth: {n} processes x 1 thread x {args.envs} envs against 1 process x {n} "
          f"threads x {n * args.envs} envs; {args.rounds} rounds of {args.seconds:g} s a side, {os.cpu_count()} cores")
    ratios = {}
    with tempfile.TemporaryDirectory() as folder:
        for backend in args.backends or BACKENDS[args.task]:
            sides = {f"{n} processes x 1 thread": (n, args.envs, 1), f"1 process x {n} threads": (1, n * args.envs, n)}
            figures: dict[str, list[float]] = {side: [] for side in sides}
            for _ in range(args.rounds):
                for side, (processes, envs, threads) in sides.items():
                    figures[side].append(host_collection(args.task, backend, processes, envs, threads, args.seconds,
                                                         folder))
            for side, values in figures.items():
                print(f"{backend:8s} {side:24s} {statistics.median(values):10,.0f} env steps/s  (rounds: "
                      f"{', '.join(f'{v:,.0f}' for v in values)})")
            one, many = figures.values()
            ratios[backend] = statistics.median(b / a for a, b in zip(one, many, strict=True))
    print(f"one process with {n} threads / {n} processes: "
          + ", ".join(f"{ratio:.2f} ({backend})" for backend, ratio in ratios.items()))


if __name__ == "__main__":
    main()
