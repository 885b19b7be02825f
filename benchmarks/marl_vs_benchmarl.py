"""gymflow's IPPO and MAPPO against BenchMARL's on MPE simple spread, the same task, budget and machine.

    .venv/bin/python benchmarks/marl_vs_benchmarl.py --setup          # BenchMARL's own environment, once
    .venv/bin/python benchmarks/marl_vs_benchmarl.py --check-env      # the two MPE builds play the same games
    .venv/bin/python benchmarks/marl_vs_benchmarl.py                  # 3 seeds a side, 1M env steps each (hours)
    .venv/bin/python benchmarks/marl_vs_benchmarl.py --report         # the table from what is recorded

The task: PettingZoo's `simple_spread_v3`, 3 agents, 25 steps a game, local_ratio 0.5, discrete
actions. gymflow trains `spread-ippo` and `spread-mappo` (mpe2's build); BenchMARL 1.5 trains its
own MAPPO and IPPO configurations (benchmarks/benchmarl_side.py says what was changed for the task)
in `.venv-benchmarl`, BenchMARL reading MPE from PettingZoo 1.24 (gymflow's PettingZoo moved MPE to
mpe2). Each run's final policy is scored the same way: the mean agent's return over 200 greedy
games seeded as gymflow's evaluation seeds them (seed 123), PettingZoo's scale, as docs/results.md.
`--check-env` plays a scripted policy's 200 games in both builds: equal returns say the two envs
are one task.

Each finished run is appended to benchmarks/records/marl-vs-benchmarl.jsonl as it ends; a later
invocation skips what is recorded (same algorithm, side, seed and budget) and goes on, so the
hours can be spread over several sessions. Sides alternate which goes first from seed to seed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "benchmarks" / "records" / "marl-vs-benchmarl.jsonl"
BENCHMARL_PYTHON = ROOT / ".venv-benchmarl" / "bin" / "python"
BENCHMARL_PACKAGES = ["benchmarl==1.5.2", "torchrl==0.11.1", "tensordict==0.11.0", "pettingzoo[mpe]==1.24.3"]
PRESETS = {"ippo": "spread-ippo", "mappo": "spread-mappo"}
GAMES, GAMES_SEED = 200, 123


def setup() -> None:
    """BenchMARL's own virtual environment beside gymflow's (it needs PettingZoo 1.24's MPE)."""
    subprocess.run([sys.executable, "-m", "venv", str(BENCHMARL_PYTHON.parents[1])], check=True)
    subprocess.run([str(BENCHMARL_PYTHON), "-m", "pip", "install", "--quiet", *BENCHMARL_PACKAGES], check=True)


def benchmarl_run(algorithm: str, seed: int, frames: int) -> dict:
    """One BenchMARL run and its games, in BenchMARL's environment."""
    done = subprocess.run([str(BENCHMARL_PYTHON), str(ROOT / "benchmarks" / "benchmarl_side.py"), "--algorithm",
                           algorithm, "--seed", str(seed), "--frames", str(frames), "--games", str(GAMES)],
                          check=True, capture_output=True, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"train_seconds": result["train_seconds"], "returns": result["returns"]}


def gymflow_run(algorithm: str, seed: int, frames: int) -> dict:
    """One gymflow run of the preset (its own settings, the budget and seed set), its final policy's games."""
    from gymflow.flows.improve import improve
    from gymflow.tasks.storage.checkpoints import POLICY_BLOB, latest_version, read_policy
    from gymflow.tasks.storage.layout import RunLayout
    from gymflow.tasks.storage.objects import Storage, StorageLocation

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from spread_on_mappo_scale import play, trained

    with tempfile.TemporaryDirectory() as folder:
        overrides = {"schedule.total_env_steps": frames, "seed": seed, "schedule.target_return": None,
                     "schedule.evaluate_every_env_steps": 10 * frames, "tracking.video": "off",
                     "storage.root": f"{folder}/data", "tracking.tracking_uri": f"sqlite:///{folder}/mlflow.db"}
        started = time.perf_counter()
        summary = improve(PRESETS[algorithm], overrides)
        seconds = time.perf_counter() - started
        storage, layout = Storage(StorageLocation(f"{folder}/data")), RunLayout(summary.run_id)
        policy_path = Path(folder) / "policy.safetensors"
        policy_path.write_bytes(read_policy(storage, layout, latest_version(storage, layout))[POLICY_BLOB])
        policy, global_state = trained(str(policy_path), PRESETS[algorithm])
        returns, _ = play(policy, GAMES, GAMES_SEED, global_state)
    return {"train_seconds": seconds, "returns": returns.tolist()}


def recorded() -> list[dict]:
    return [json.loads(line) for line in RECORDS.read_text().splitlines() if line.strip()] if RECORDS.exists() else []


def run_all(seeds: int, frames: int, algorithms: list[str]) -> None:
    from prefect.testing.utilities import prefect_test_harness

    done = {(r["algorithm"], r["side"], r["seed"], r["frames"]) for r in recorded()}
    sides = {"gymflow": gymflow_run, "benchmarl": benchmarl_run}
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "0")
    with prefect_test_harness(server_startup_timeout=120):
        for seed in range(seeds):
            for algorithm in algorithms:
                order = list(sides) if seed % 2 == 0 else list(reversed(sides))  # alternate: the VM drifts
                for side in order:
                    if (algorithm, side, seed, frames) in done:
                        continue
                    result = sides[side](algorithm, seed, frames)
                    record = {"algorithm": algorithm, "side": side, "seed": seed, "frames": frames,
                              "mean_return": float(np.mean(result["returns"])), **result,
                              "machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
                              "date": date.today().isoformat()}
                    RECORDS.parent.mkdir(parents=True, exist_ok=True)
                    with RECORDS.open("a") as out:
                        out.write(json.dumps(record) + "\n")
                    print(f"{algorithm} {side} seed {seed}: {record['mean_return']:.2f} over {GAMES} games, "
                          f"{result['train_seconds'] / 60:.1f} min", flush=True)


def report(frames: int) -> None:
    """Each algorithm and side: IQM over seeds with its 95% bootstrap interval, each seed, wall-clock."""
    from gymflow.tasks.sweep.aggregate import iqm_with_interval

    rows = [r for r in recorded() if r["frames"] == frames]
    print("| algorithm | side | seeds | IQM [95% CI] | each seed | minutes a run (median) |\n|---|---|---|---|---|---|")
    for algorithm in PRESETS:
        for side in ("gymflow", "benchmarl"):
            runs = sorted((r for r in rows if r["algorithm"] == algorithm and r["side"] == side), key=lambda r: r["seed"])
            if not runs:
                continue
            scores = np.array([r["mean_return"] for r in runs])
            estimate = iqm_with_interval(scores)
            minutes = np.median([r["train_seconds"] for r in runs]) / 60
            print(f"| {algorithm.upper()} | {side} | {len(runs)} | **{estimate.value:.1f}** [{estimate.low:.1f}, "
                  f"{estimate.high:.1f}] | {', '.join(f'{s:.1f}' for s in scores)} | {minutes:.1f} |")


def check_env() -> None:
    """The scripted policy's games in PettingZoo 1.24's MPE (BenchMARL's) and in mpe2 (gymflow's)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from spread_on_mappo_scale import Scripted, play

    theirs = json.loads(subprocess.run([str(BENCHMARL_PYTHON), str(ROOT / "benchmarks" / "benchmarl_side.py"),
                                        "--play-scripted", "--games", str(GAMES)], check=True, capture_output=True,
                                       text=True).stdout.strip().splitlines()[-1])["scripted"]
    ours, _ = play(Scripted(), GAMES, GAMES_SEED)
    print(f"scripted policy, {GAMES} games: PettingZoo 1.24 MPE {np.mean(theirs):.4f}, mpe2 {ours.mean():.4f}, "
          f"largest difference of a game {np.max(np.abs(np.array(theirs) - ours)):.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", action="store_true", help="make .venv-benchmarl (BenchMARL and its PettingZoo)")
    parser.add_argument("--check-env", action="store_true", help="the two MPE builds against each other")
    parser.add_argument("--report", action="store_true", help="only the table of what is recorded")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--frames", type=int, default=1_000_000, help="env steps a run (games' joint steps)")
    parser.add_argument("--algorithms", nargs="+", choices=list(PRESETS), default=list(PRESETS))
    args = parser.parse_args()
    if args.setup:
        setup()
    elif args.check_env:
        check_env()
    elif args.report:
        report(args.frames)
    else:
        run_all(args.seeds, args.frames, args.algorithms)
        report(args.frames)


if __name__ == "__main__":
    main()
