"""Population-based training against fixed configurations at equal compute, on the same machine:
each side spends `population x steps` env steps of `lunarlander-ppo` (target off) in one
`gymflow sweep` command:

- pbt:    `sampler: pbt`, `population` members, a decision every `interval` env steps;
- random: the existing sweep, `sampler: random` over the same space, `population` configurations
          of one seed each (the best fixed configuration a search of that compute finds);
- preset: `lunarlander-ppo` as shipped, `population` seeds.

Each side's result is what a user takes away: its best run's final evaluation (the best member,
the best configuration, the best seed: the same selection on every side), and beside it the
median over its runs. Sides alternate order from repeat to repeat; each (repeat, side) is
recorded in `benchmarks/records/pbt-vs-fixed-STEPS.jsonl` as it ends, so a later invocation
continues where the last one stopped. `--sequential` also runs repeat 0's population with
concurrency 1 (SYNC: the same numbers), for the wall-clock of its members one after another.

    .venv/bin/pip install -e ".[box2d]"
    .venv/bin/python benchmarks/pbt_vs_fixed.py --steps 200000 --population 4 --interval 50000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import optuna
import yaml

from gymflow.tasks.sweep.aggregate import iqm_with_interval

GYMFLOW = str(Path(sys.executable).with_name("gymflow"))
RECORDS = Path(__file__).resolve().parent / "records"
SPACE = {"agent.lr": {"low": 0.0001, "high": 0.003, "log": True}, "agent.clip_range": {"values": [0.1, 0.2, 0.3]},
         "agent.entropy_coef": {"low": 0.0, "high": 0.02}}
SIDES = ("pbt", "random", "preset")


def spec(side: str, folder: Path, args: argparse.Namespace, repeat: int) -> dict:
    """One side's sweep spec; repeat r uses the preset's seed 100 r and sampler seed r."""
    common = {
        "preset": "lunarlander-ppo",
        "overrides": {"schedule.total_env_steps": args.steps, "schedule.target_return": None,
                      "schedule.evaluate_every_env_steps": args.interval, "seed": 100 * repeat,
                      "storage.root": str(folder / "data"), "tracking.tracking_uri": f"sqlite:///{folder / 'mlflow.db'}"},
        "concurrency": args.population,
        "study_storage": f"sqlite:///{folder / 'sweeps.db'}",
        "sampler_seed": repeat,
    }
    if side.startswith("pbt"):
        return {**common, "space": SPACE, "sampler": "pbt",
                "pbt": {"population": args.population, "interval": args.interval},
                "concurrency": 1 if side == "pbt-sequential" else args.population}
    if side == "random":
        return {**common, "space": SPACE, "sampler": "random", "trials": args.population, "seeds": 1}
    return {**common, "space": {"agent.lr": {"values": [0.0003]}}, "sampler": "grid", "seeds": args.population}


def run_side(side: str, args: argparse.Namespace, repeat: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"pbt-bench-{side}-") as name:
        folder = Path(name)
        (folder / "spec.yaml").write_text(yaml.safe_dump(spec(side, folder, args, repeat)))
        started = time.perf_counter()
        done = subprocess.run([GYMFLOW, "sweep", str(folder / "spec.yaml"), "--id", f"{side}-{repeat}"],
                              capture_output=True, text=True, cwd=folder)
        seconds = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(f"{side} repeat {repeat} failed:\n{done.stderr[-3000:]}")
        finals = _finals(side, folder, f"{side}-{repeat}", done.stdout)
    return {"side": side, "repeat": repeat, "steps": args.steps, "population": args.population,
            "interval": args.interval, "best": max(finals), "median": statistics.median(finals),
            "finals": finals, "wall_seconds": round(seconds, 1)}


def _finals(side: str, folder: Path, sweep_id: str, stdout: str) -> list[float]:
    """Every run's final evaluation: the members', the configurations', or the seeds'."""
    ranking = yaml.safe_load(stdout.split("\n", 1)[1].split("best configuration as a preset")[0])
    if side.startswith("pbt"):
        return [float(row["final return"]) for row in ranking]
    if side == "random":
        return [float(row["final return IQM"]) for row in ranking if row["final return IQM"] is not None]
    study = optuna.load_study(study_name=sweep_id, storage=f"sqlite:///{folder / 'sweeps.db'}")
    return [json.loads(value)["final_return"] for trial in study.trials for key, value in trial.user_attrs.items()
            if key.startswith("seed:")]


def report(records: list[dict]) -> None:
    print(f"{'side':<16}{'repeats':>8}{'best: IQM':>11}{'95% CI':>20}{'median run':>12}{'wall s':>9}   best by repeat")
    for side in (*SIDES, "pbt-sequential"):
        rows = sorted((r for r in records if r["side"] == side), key=lambda r: r["repeat"])
        if not rows:
            continue
        best = iqm_with_interval(np.array([r["best"] for r in rows]))
        interval = f"[{best.low:.1f}, {best.high:.1f}]"
        median_run = statistics.median(r["median"] for r in rows)
        wall = statistics.median(r["wall_seconds"] for r in rows)
        each = ", ".join(f"{r['best']:.1f}" for r in rows)
        print(f"{side:<16}{len(rows):>8}{best.value:>11.1f}{interval:>20}{median_run:>12.1f}{wall:>9.0f}   {each}")
    by_side = {side: {r["repeat"]: r["best"] for r in records if r["side"] == side} for side in SIDES}
    for other in ("random", "preset"):
        paired = [by_side["pbt"][k] - by_side[other][k] for k in by_side["pbt"] if k in by_side[other]]
        if paired:
            print(f"pbt - {other}: {', '.join(f'{d:+.1f}' for d in paired)} (per repeat)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200_000, help="env steps of each run (member, configuration, seed)")
    parser.add_argument("--population", type=int, default=4, help="runs per side: members, configurations, seeds")
    parser.add_argument("--interval", type=int, default=50_000, help="PBT's interval, and every side's evaluation cadence")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sequential", action="store_true", help="also repeat 0's population one member at a time")
    args = parser.parse_args()
    RECORDS.mkdir(exist_ok=True)
    path = RECORDS / f"pbt-vs-fixed-{args.steps}.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    wanted = [(repeat, side) for repeat in range(args.repeats)
              for side in (SIDES if repeat % 2 == 0 else SIDES[::-1])]  # alternate the order
    if args.sequential:
        wanted.append((0, "pbt-sequential"))
    for repeat, side in wanted:
        if any(r["side"] == side and r["repeat"] == repeat and r["population"] == args.population for r in records):
            continue
        record = run_side(side, args, repeat)
        records.append(record)
        with path.open("a") as stream:
            stream.write(json.dumps(record) + "\n")
        print(f"repeat {repeat} {side}: best {record['best']:.1f}, median {record['median']:.1f}, "
              f"{record['wall_seconds']:.0f} s", flush=True)
    report([r for r in records if r["population"] == args.population])


if __name__ == "__main__":
    main()
