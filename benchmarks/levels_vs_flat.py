"""Two levels against one flat policy at the same budget of the lower env's steps: Hallway's exit
task (envs/hallway.py: 61 cells, start in the middle, +1 at the exit, one end or the other as the
observation shows, 0 at the other end, 100 steps a game).

    .venv/bin/python benchmarks/levels_vs_flat.py --budget 100000 --seeds 0 1 2

Two levels (Coach's hierarchy, agents/levels.py): `hallway-walk-ppo` learns the walking skills
(walk left, walk right) until its evaluations reach its target; then a level above, `hallway-ppo`
with `env.id: gymflow.agents.levels:Level`, chooses which skill to walk every 5 steps of the
hallway. Its budget is what the skills left of the whole: (budget - skill steps) / 5 level steps,
each at most 5 hallway steps. Two levels over a group: the same, but each skill is a policy of its
own (`hallway-walk-ppo` with `env.kwargs.option` 0, then 1: two runs, both counted in the budget)
and the level above chooses which policy walks. One flat policy: `hallway-ppo` on the hallway itself, the whole
budget. Both stop at their target (an evaluation return of 0.95: 20 greedy games). Each side is a
gymflow run as a user makes it (`improve`, single mode: storage, MLflow, the Prefect API).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import NamedTuple

EVERY = 5  # hallway steps per choice of the level above


class Outcome(NamedTuple):
    solved: bool
    final_return: float
    hallway_steps: int  # the lower env's steps spent, skills included (the level's: at most EVERY each)


def run(preset: str, folder: str, seed: int, overrides: dict):
    from gymflow.flows.improve import improve

    return improve(preset, {"seed": seed, "distribution.mode": "single", "tracking.video": "off",
                            "storage.root": os.path.join(folder, "data"), "tracking.tracking_uri":
                            f"sqlite:///{folder}/mlflow.db", "tracking.artifact_location": f"{folder}/mlartifacts",
                            **overrides})


def delivered_policy(folder: str, summary) -> str:
    return str(Path(folder, "data", "runs", summary.run_id, "policies", f"v{summary.delivered_version:06d}",
                    "policy.safetensors"))


def two_levels(seed: int, budget: int, folder: str, group: bool = False) -> Outcome:
    """The skills (one policy with both options, or with `group` one policy a skill), then the level above."""
    if group:
        skills = [run("hallway-walk-ppo", folder, seed, {"env.kwargs.option": option}) for option in (0, 1)]
    else:
        skills = [run("hallway-walk-ppo", folder, seed, {})]
    policies = [delivered_policy(folder, summary) for summary in skills]
    skill_steps = sum(summary.env_steps for summary in skills)
    level = run("hallway-ppo", folder, seed, {
        "env.id": "gymflow.agents.levels:Level",
        "env.kwargs": {"lower_preset": "hallway-walk-ppo", "policy": policies if group else policies[0],
                       "every": EVERY, "env_kwargs": {"task": "exit", "max_steps": 100}},
        "schedule.total_env_steps": (budget - skill_steps) // EVERY, "schedule.evaluate_every_env_steps": 1024,
    })
    return Outcome(level.solved, level.final_return, skill_steps + level.env_steps * EVERY)


def flat(seed: int, budget: int, folder: str) -> Outcome:
    summary = run("hallway-ppo", folder, seed, {"schedule.total_env_steps": budget})
    return Outcome(summary.solved, summary.final_return, summary.env_steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=100_000, help="hallway steps each side may spend")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    args = parser.parse_args()
    sides = {"two levels": lambda seed, folder: two_levels(seed, args.budget, folder),
             "two levels over a group": lambda seed, folder: two_levels(seed, args.budget, folder, group=True),
             "flat": lambda seed, folder: flat(seed, args.budget, folder)}
    solved = dict.fromkeys(sides, 0)
    with tempfile.TemporaryDirectory() as folder:
        for seed in args.seeds:
            outcomes = {side: play(seed, folder) for side, play in sides.items()}
            for side, outcome in outcomes.items():
                solved[side] += outcome.solved
            print(f"seed {seed}: " + "; ".join(
                f"{side} {o.final_return:.2f} after <= {o.hallway_steps:,} hallway steps "
                f"({'solved' if o.solved else 'not solved'})" for side, o in outcomes.items()), flush=True)
    print(f"\nmachine: {os.cpu_count()} cores; Hallway exit task, budget {args.budget:,} hallway steps a side")
    print(", ".join(f"{side} solved {count} of {len(args.seeds)} seeds" for side, count in solved.items()))


if __name__ == "__main__":
    main()
