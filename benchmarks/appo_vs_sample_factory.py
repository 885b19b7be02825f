"""Breakout APPO training throughput on the CPU: gymflow's `breakout-appo` against Sample Factory
2.1.1's APPO with the same rollout, batch, epochs and Nature CNN, both on EnvPool, alternating run
by run in one invocation.

    # Sample Factory in a venv of its own (benchmarks/sample_factory_side.py has the install commands)
    .venv/bin/python benchmarks/appo_vs_sample_factory.py --steps 32768 --rounds 3 --sf-python /tmp/sf-venv/bin/python

Each round trains both sides `--steps` env steps (agent steps; a step is 4 frames), the side going
first alternating round by round (the VM drifts), 2 rollout workers x 8 envs, 128 steps a chunk,
the learner on the CPU with one torch thread:
- **gymflow** `breakout-appo` with distribution.rollout_workers=2, distribution.envs_per_worker=8,
  env.backend=envpool, distribution.learner_device=cpu, distribution.learner_threads=1, run end to
  end by `improve` as benchmarks/atari_throughput.py runs it (whose functions this imports: a
  LocalCluster, the temporary Prefect API, MLflow, storage; evaluations pushed past the run, no
  films). Its figure: env steps per second from the MLflow metrics its learner logs (env steps
  learned from, against their timestamps) after the first quarter of the run's steps.
- **Sample Factory** APPO (benchmarks/sample_factory_side.py, run by `--sf-python` in a
  subprocess): SF's EnvPool Atari example with the preset's settings mapped flag by flag (that
  script's docstring has the mapping and what SF cannot match). Its figure: env steps (not SF's
  frames: frames / 4) learned from per second, from its learner's reports of its env-step count
  timestamped by the runner, after the first quarter of the run's steps.

Both figures count steps the learner has learned from over the same window of a run; startup,
warm-up and shutdown are left out of both. The report: each round's figures, the medians and
gymflow / SF.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from atari_throughput import gymflow_overrides, train_with_gymflow

HERE = Path(__file__).resolve().parent
PRESET = "breakout-appo"


def run_gymflow(steps: int, workers: int, envs: int) -> float:
    overrides = gymflow_overrides(workers, envs, steps, learner_threads=1, gpu=False, epochs=None, backend="envpool")
    measured = train_with_gymflow(PRESET, overrides, tempfile.mkdtemp(prefix="gymflow-appo-"),
                                  f"gymflow APPO ({PRESET})", workers)
    could = measured.workers_could
    could = f", its workers collecting alone {could:,.1f} env steps/s" if could else ""
    busy = f"learner busy {measured.learner_busy:.0%}" if measured.learner_busy is not None else ""
    print(f"      gymflow: {busy}{could}")
    return measured.env_steps_per_second


def run_sample_factory(python: str, steps: int, workers: int, envs: int, timeout: float, extra: list[str]) -> float:
    command = [python, str(HERE / "sample_factory_side.py"), "--env-steps", str(steps), "--workers", str(workers),
               "--envs-per-worker", str(envs), *extra]
    started = time.perf_counter()
    # its own session: a hung SF (its children linger when one fails) is ended as a group
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        output, _ = process.communicate()
        raise RuntimeError(f"Sample Factory ran past {timeout:.0f} s:\n{output[-3000:]}") from None
    found = re.findall(r"^env_steps_per_second ([0-9.]+)$", output, re.MULTILINE)
    if process.returncode != 0 or not found:
        raise RuntimeError(f"Sample Factory failed (exit {process.returncode}):\n{output[-3000:]}")
    for line in output.splitlines():
        if line.startswith(("Sample Factory APPO:", "(its workers")):
            print(f"      {line}")
    print(f"      (subprocess {time.perf_counter() - started:.0f} s)")
    return float(found[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32768, help="env steps a training run, each side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sf-python", default="/tmp/sf-venv/bin/python", help="the Sample Factory venv's python")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--envs-per-worker", type=int, default=8)
    parser.add_argument("--sf-timeout", type=float, default=None, help="seconds (default: 60 + steps / 50)")
    parser.add_argument("--sf-no-vtrace", action="store_true", help="SF with GAE instead of V-trace")
    parser.add_argument("--only", choices=["gymflow", "sf"], default=None, help="one side alone (smoke tests)")
    args = parser.parse_args()
    timeout = args.sf_timeout or 60 + args.steps / 50
    extra = ["--no-vtrace"] if args.sf_no_vtrace else []
    print(f"Breakout APPO, CPU learner: {args.workers} workers x {args.envs_per_worker} envs x 128 steps, "
          f"{args.steps:,} env steps a run, {args.rounds} rounds, {os.cpu_count()} cores", flush=True)

    sides = {"gymflow": lambda: run_gymflow(args.steps, args.workers, args.envs_per_worker),
             "sf": lambda: run_sample_factory(args.sf_python, args.steps, args.workers, args.envs_per_worker,
                                              timeout, extra)}
    names = {"gymflow": f"gymflow {PRESET}", "sf": "Sample Factory 2.1.1 APPO"}
    if args.only:
        sides = {args.only: sides[args.only]}
    rates: dict[str, list[float]] = {key: [] for key in sides}
    from prefect.testing.utilities import prefect_test_harness

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "0")  # as gymflow's own temporary API: no telemetry
    with prefect_test_harness(server_startup_timeout=120):  # one temporary Prefect API for every gymflow run
        for round_ in range(args.rounds):
            order = list(sides) if round_ % 2 == 0 else list(reversed(sides))  # alternate who goes first
            for key in order:
                rate = sides[key]()
                rates[key].append(rate)
                print(f"  [round {round_}] {names[key]}: {rate:,.1f} env steps/s", flush=True)

    print(f"\n{'side':32} {'median env steps/s':>19} {'frames/s':>9}  rounds")
    medians = {key: statistics.median(values) for key, values in rates.items()}
    for key, values in rates.items():
        print(f"{names[key]:32} {medians[key]:19,.1f} {4 * medians[key]:9,.0f}  "
              + ", ".join(f"{value:,.1f}" for value in values))
    if len(medians) == 2:
        print(f"\ngymflow / Sample Factory: {medians['gymflow'] / medians['sf']:.2f}x env steps/s")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
