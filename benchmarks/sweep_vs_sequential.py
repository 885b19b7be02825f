"""A real sweep against the same runs one after another: `gymflow sweep` of cartpole-ppo over a
grid of 2 fields (agent.lr x agent.epochs, 2 values each) x 3 seeds, concurrency 2, against
`gymflow run cartpole-ppo --set ...` for each of those 12 runs in turn, on the same machine.
The two sides alternate (sweep, runs, runs, sweep with --repeats 2), each in a fresh folder.

    .venv/bin/python benchmarks/sweep_vs_sequential.py --steps 20000 --repeats 2

Prints each side's wall-clock (the whole command, Prefect API start-up included), the ratio, the
sweep's ranking, and the per-configuration mean of the sequential runs' final returns: SYNC runs
are deterministic, so the two sides must agree run for run.
"""

from __future__ import annotations

import argparse
import itertools
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

GYMFLOW = str(Path(sys.executable).with_name("gymflow"))
SPACE = {"agent.lr": [0.001, 0.003], "agent.epochs": [4, 10]}
SEEDS = 3
FINAL_RETURN = re.compile(r"evaluation return (-?[0-9.]+)")


def sweep_spec(folder: Path, steps: int) -> dict:
    return {
        "preset": "cartpole-ppo",
        "overrides": _fixed(folder, steps),
        "space": {key: {"values": values} for key, values in SPACE.items()},
        "sampler": "grid",
        "seeds": SEEDS,
        "concurrency": 2,
        "study_storage": f"sqlite:///{folder / 'sweeps.db'}",
    }


def _fixed(folder: Path, steps: int) -> dict:
    return {"schedule.total_env_steps": steps, "storage.root": str(folder / "data"),
            "tracking.tracking_uri": f"sqlite:///{folder / 'mlflow.db'}"}


def run_sweep(folder: Path, steps: int) -> tuple[float, list[dict]]:
    spec_path = folder / "sweep.yaml"
    spec_path.write_text(yaml.safe_dump(sweep_spec(folder, steps)))
    started = time.perf_counter()
    done = subprocess.run([GYMFLOW, "sweep", str(spec_path)], capture_output=True, text=True, cwd=folder)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    ranking = yaml.safe_load(done.stdout.split("\n", 1)[1].split("best configuration as a preset")[0])
    return seconds, ranking


def run_sequentially(folder: Path, steps: int) -> tuple[float, dict[tuple, list[float]]]:
    finals: dict[tuple, list[float]] = {}
    started = time.perf_counter()
    for values in itertools.product(*SPACE.values()):
        for seed in range(SEEDS):
            settings = {**_fixed(folder, steps), **dict(zip(SPACE, values)), "seed": seed}
            done = subprocess.run([GYMFLOW, "run", "cartpole-ppo", "--quiet",
                                   *(f"--set={key}={value}" for key, value in settings.items())],
                                  capture_output=True, text=True, cwd=folder)
            if done.returncode != 0:
                raise RuntimeError(done.stderr[-3000:])
            finals.setdefault(values, []).append(float(FINAL_RETURN.search(done.stdout).group(1)))
    return time.perf_counter() - started, finals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20_000, help="env steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="pairs of (sweep, sequential), alternating")
    args = parser.parse_args()
    sweep_seconds, sequential_seconds = [], []
    ranking, finals = [], {}
    with tempfile.TemporaryDirectory() as temporary:
        for repeat in range(args.repeats):
            order = ("sweep", "sequential") if repeat % 2 == 0 else ("sequential", "sweep")
            for side in order:
                folder = Path(temporary, f"{side}-{repeat}")
                folder.mkdir()
                if side == "sweep":
                    seconds, ranking = run_sweep(folder, args.steps)
                    sweep_seconds.append(seconds)
                else:
                    seconds, finals = run_sequentially(folder, args.steps)
                    sequential_seconds.append(seconds)
                print(f"repeat {repeat} {side:<10} {seconds:7.1f} s", flush=True)
    sweep_median, sequential_median = statistics.median(sweep_seconds), statistics.median(sequential_seconds)
    runs = len(list(itertools.product(*SPACE.values()))) * SEEDS
    print(f"\n{runs} runs of {args.steps:,} env steps: sweep (concurrency 2) {sweep_median:.1f} s, one after another "
          f"{sequential_median:.1f} s; sweep / sequential = {sweep_median / sequential_median:.2f}")
    print("\nthe sweep's ranking:")
    for row in ranking:
        values = tuple(row[key] for key in SPACE)
        sequential = statistics.mean(finals[values]) if values in finals else float("nan")
        print(f"  #{row['rank']} {dict(zip(SPACE, values))}: IQM {row['final return IQM']} "
              f"{row['final return 95% CI']}, AUC IQM {row['AUC IQM']}; sequential runs' mean {sequential:.2f}")


if __name__ == "__main__":
    main()
