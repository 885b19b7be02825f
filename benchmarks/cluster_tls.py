"""What mutual TLS on the run's own Dask cluster costs: `gymflow run cartpole-ppo` (the README's
command, solving CartPole) with the cluster's TLS on (the default) and off
(`distribution.cluster_tls=false`, plain tcp), each a new process, the two alternating, `--repeats`
times; medians of the whole command, of when the cluster was ready, and the ratio TLS / plain.

    .venv/bin/python benchmarks/cluster_tls.py --repeats 3

Each side keeps one working folder, warmed by a first run that is not counted; no Prefect API is
configured, so each run starts its temporary one, as a user's first command does.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from startup_vs_sb3 import run_gymflow  # noqa: E402 (the same timed command, milestones and all)

SIDES = {"tls": ("distribution.cluster_tls=true",), "plain": ("distribution.cluster_tls=false",)}
READY = "rollout workers ready: training starts"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    folders = {side: tempfile.mkdtemp(prefix=f"cluster-{side}-") for side in SIDES}
    for side, changes in SIDES.items():  # the warm-up: a project folder that has seen a run, a warm page cache
        run_gymflow(100, folders[side], changes)
    walls: dict[str, list[float]] = {side: [] for side in SIDES}
    ready: dict[str, list[float]] = {side: [] for side in SIDES}
    for repeat in range(args.repeats):
        order = list(SIDES) if repeat % 2 == 0 else list(reversed(SIDES))  # alternate who goes first
        for side in order:
            wall, seen, output = run_gymflow(repeat, folders[side], SIDES[side])
            walls[side].append(wall)
            if READY in seen:
                ready[side].append(seen[READY])
            verdict = next((line.strip() for line in output.splitlines() if "its target" in line), "?")
            print(f"repeat {repeat}: {side:5} {wall:6.1f} s (workers ready at {seen.get(READY, float('nan')):5.1f} s)"
                  f"  {verdict[:90]}", flush=True)
    for folder in folders.values():
        shutil.rmtree(folder, ignore_errors=True)
    wall = {side: statistics.median(values) for side, values in walls.items()}
    up = {side: statistics.median(values) if values else float("nan") for side, values in ready.items()}
    print(f"\nmedian of {args.repeats}: whole command TLS {wall['tls']:.1f} s, plain {wall['plain']:.1f} s, "
          f"TLS / plain = {wall['tls'] / wall['plain']:.2f}; workers ready at TLS {up['tls']:.1f} s, "
          f"plain {up['plain']:.1f} s")


if __name__ == "__main__":
    main()
