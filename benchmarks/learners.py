"""Learning updates per second on one rank against several (distribution.learners), the sides
alternating in one run.

    .venv/bin/python benchmarks/learners.py                       # breakout-ppo's CNN, 1 and 2 ranks
    .venv/bin/python benchmarks/learners.py --presets breakout-ppo hopper-ppo --ranks 1 2 1x2 --rounds 3

Each side is a run's learner as the flow makes it (the preset's agent, one torch thread a rank;
`RxT` is R ranks of T threads each, `1x2` the one learner given the second core as a thread),
learning one round of random rollouts of the preset's shapes (rollout_workers x envs_per_worker x
rollout_steps_per_env steps, its epochs of minibatches: `learn`); N > 1 is the real path,
tasks/training/learner_ranks.py's children beside this process, each round's rollouts sent to
them, gloo over loopback. The ranks' children are started once per side and kept across rounds
(their start is a run's, not a round's). Prints each round's figures, then per preset the
medians (minibatch updates per second) and the ratio of each side's to the first's.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import numpy as np
import torch

from gymflow.agents.core import Learner
from gymflow.presets.validate import resolve_experiment
from gymflow.tasks.training.learner_ranks import LearnerRanks
from gymflow.testing.rollouts import random_rollout


class Side:
    """One number of ranks: its learner (with its ranks' children where N > 1) and the round it learns."""

    def __init__(self, preset: str, name: str):
        ranks, _, threads = name.partition("x")
        self.ranks, self.threads = int(ranks), int(threads or 1)
        experiment = resolve_experiment(preset, {"distribution.learners": self.ranks, "distribution.learner_device":
                                                 "cpu", "distribution.learner_threads": self.threads})
        config, ranks = experiment.preset, self.ranks
        torch.set_num_threads(self.threads)
        self.learner: Learner = experiment.algorithm.learner(config.agent, experiment.observation_space,
                                                             experiment.action_space, config.seed, "cpu")
        distribution = config.distribution
        self.rollout = random_rollout(experiment.observation_space, experiment.action_space,
                                      config.schedule.rollout_steps_per_env,
                                      distribution.rollout_workers * distribution.envs_per_worker,
                                      np.random.default_rng(0))
        self.group = LearnerRanks(self.learner, config, ["cpu"] * ranks, logging.getLogger("learners")) \
            if ranks > 1 else None
        self.updates_per_second()  # warm-up: the children connect, allocations, kernels chosen

    def updates_per_second(self) -> float:
        torch.set_num_threads(self.threads)
        before = self.learner.train_steps
        started = time.perf_counter()
        if self.group is None:
            self.learner.learn([self.rollout], 0.0)
        else:
            self.group.learn([self.rollout], 0.0)
        return (self.learner.train_steps - before) / (time.perf_counter() - started)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()


def compare(preset: str, ranks: list[str], rounds: int) -> dict[str, float]:
    """Median minibatch updates per second of each side, over `rounds` alternating rounds."""
    sides: dict[str, Side] = {}
    figures: dict[str, list[float]] = {name: [] for name in ranks}
    try:
        for name in ranks:  # inside: a side that fails to start ends the others' rank children
            sides[name] = Side(preset, name)
        for round_index in range(rounds):
            order = ranks if round_index % 2 == 0 else ranks[::-1]
            for count in order:
                figures[count].append(sides[count].updates_per_second())
            print(f"{preset} round {round_index}: " + ", ".join(f"{_named(n)} {figures[n][-1]:.2f}" for n in order)
                  + " updates/s", flush=True)
    finally:
        for side in sides.values():
            side.close()
    return {count: statistics.median(values) for count, values in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["breakout-ppo"])
    parser.add_argument("--ranks", nargs="+", default=["1", "2"], help="sides: N ranks, or RxT (threads each)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ratios = []
    for preset in args.presets:
        medians = compare(preset, args.ranks, args.rounds)
        first = args.ranks[0]
        print(f"{preset}: " + ", ".join(f"{_named(n)} {medians[n]:.2f}" for n in args.ranks) + " updates/s (medians)")
        ratios += [f"{medians[n] / medians[first]:.2f} ({preset}, {_named(n)})" for n in args.ranks[1:]]
    print(f"updates per second / {_named(args.ranks[0])}'s: {', '.join(ratios)}")


def _named(side: str) -> str:
    ranks, _, threads = side.partition("x")
    return f"{ranks} rank{'s' if ranks != '1' else ''}" + (f" x {threads} threads" if threads else "")


if __name__ == "__main__":
    main()
