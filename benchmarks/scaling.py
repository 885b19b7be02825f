"""Collection throughput with 1, 2, 4, ... rollout workers, and efficiency against linear.

    .venv/bin/python benchmarks/scaling.py --workers 1 2 4

Each point is gymflow's rollout rounds (benchmarks/collection_throughput.py) with that many
Dask worker processes; the LocalCluster has at most one process per core, so past the core
count extra rollout jobs queue. Efficiency = throughput / (workers used x one-worker throughput).
"""

from __future__ import annotations

import argparse
import os

from collection_throughput import gymflow_throughput


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    rows = [(w, *gymflow_throughput(w, args.envs, args.steps, args.rounds)) for w in args.workers]
    single = next((rate for w, rate, _ in rows if w == 1), rows[0][1] / rows[0][0])
    print(f"\nmachine: {os.cpu_count()} cores; CartPole-v1, {args.envs} envs x {args.steps} steps per job")
    print(f"{'workers':>7} {'processes':>9} {'env steps/s':>12} {'round ms':>9} {'vs linear':>9}")
    for workers, rate, seconds in rows:
        processes = min(workers, os.cpu_count() or 1)
        print(f"{workers:>7} {processes:>9} {rate:>12,.0f} {1000 * seconds:>9.1f} {rate / (processes * single):>9.2f}")


if __name__ == "__main__":
    main()
