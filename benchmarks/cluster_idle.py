"""CPU that a run's LocalCluster spends on its own housekeeping, with gymflow's clocks against Dask's.

    .venv/bin/python benchmarks/cluster_idle.py --workers 2 --seconds 40 --pairs 3

Each side starts the LocalCluster a run starts (tasks/cluster/client.py's `_local_cluster`: workers
forked from the fork server, the profiler off, the same preload), in a fresh process of its own, lets
it settle 5 s, then reads the CPU time of that process and every process under it (scheduler and
nannies in it, the workers under it) over `--seconds` with nothing submitted. Baseline: the same
cluster with Dask's own housekeeping clocks (the event loop's tick every 20 ms, the memory monitor
every 100 ms, the system monitor every 500 ms); gymflow: WORKER_CONFIG's. The two sides alternate,
pair by pair, because these VMs' per-core speed drifts by tens of percent within minutes.
Printed: CPU seconds a minute for each side, each pair's ratio and the median ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def idle_cpu_per_minute(workers: int, seconds: float, dasks_clocks: bool) -> float:
    """CPU seconds a minute of an idle LocalCluster as a run starts it (in this process)."""
    import psutil
    from distributed import Client

    from gymflow.presets.model import DistributionConfig
    from gymflow.tasks.cluster import client as clusters
    from gymflow.tasks.cluster.clocks import HOUSEKEEPING_CLOCKS

    if dasks_clocks:  # the same cluster, Dask's defaults for the three clocks
        clusters.WORKER_CONFIG = {key: value for key, value in clusters.WORKER_CONFIG.items() if key not in HOUSEKEEPING_CLOCKS}
    with clusters._local_cluster(DistributionConfig(rollout_workers=workers), workers) as cluster, Client(cluster):
        this = psutil.Process()
        time.sleep(5)  # started and settled
        before, began = _cpu_of(this), time.monotonic()
        time.sleep(seconds)
        return (_cpu_of(this) - before) / (time.monotonic() - began) * 60


def _cpu_of(process) -> float:
    import psutil

    total = 0.0
    for each in [process, *process.children(recursive=True)]:
        try:
            times = each.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def _side(workers: int, seconds: float, dasks_clocks: bool) -> float:
    command = [sys.executable, __file__, "--side", "dask" if dasks_clocks else "gymflow", "--workers", str(workers),
               "--seconds", str(seconds)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["cpu_s_a_minute"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--side", choices=["dask", "gymflow"], help=argparse.SUPPRESS)  # one side, in its own process
    args = parser.parse_args()
    if args.side:
        print(json.dumps({"cpu_s_a_minute": idle_cpu_per_minute(args.workers, args.seconds, args.side == "dask")}))
        return
    ratios = []
    for pair in range(args.pairs):
        dasks = _side(args.workers, args.seconds, dasks_clocks=True)
        gymflows = _side(args.workers, args.seconds, dasks_clocks=False)
        ratios.append(gymflows / dasks)
        print(f"pair {pair + 1}: Dask's clocks {dasks:.2f} CPU-s a minute, gymflow's {gymflows:.2f}: "
              f"gymflow/Dask {ratios[-1]:.2f}", flush=True)
    print(f"idle LocalCluster of {args.workers} workers, {args.pairs} pairs of {args.seconds:.0f} s: "
          f"median gymflow/Dask {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")


if __name__ == "__main__":
    main()
