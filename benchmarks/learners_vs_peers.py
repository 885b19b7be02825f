"""Off-policy learner updates a second: gymflow's SAC and TD3 against SBX's (Stable-Baselines3 on JAX)
and Stable-Baselines3's, on HalfCheetah-v5's shapes, the sides alternating in one run.

    .venv/bin/pip install -e ".[bench,mujoco]"
    # SBX in a venv of its own (its commands: benchmarks/sbx_side.py's docstring), then
    .venv/bin/python benchmarks/learners_vs_peers.py --sbx-python /tmp/sbx-venv/bin/python --rounds 5

Each side is what a real run does, on the same two CPU threads:
- gymflow: the learner the preset makes (halfcheetah-sac; hopper-td3 on HalfCheetah-v5, 400x300),
  `train(N)`: N updates, each sampling its batch of 256 from the replay memory (2,000 random
  transitions) and stepping the critics, the actor (TD3: every second update) and the temperature.
  A run calls it with the preset's 64 updates a round.
- SBX 0.28: `model.train(gradient_steps=1, batch_size=256)` N times after a fill of 2,000 env steps
  (its own loop calls it once an env step: train_freq 1), in a process of its own driven over a pipe
  (benchmarks/sbx_side.py); it blocks on the parameters before it reports.
- SB3 (in this process, `--peers sb3`): the same calls on its PyTorch policies. gymflow's SAC and
  TD3 learners compute denormal floats as zero (agents/denormals.py), as XLA does for SBX; that
  holds for this whole process, SB3's side included.

The peers' settings: rl-zoo's (SAC lr 3e-4, gamma 0.99, tau 0.005, buffer 1e6, automatic entropy,
256x256; TD3 lr 1e-3, policy delay 2, target noise 0.2 clipped at 0.5, 400x300), as gymflow's presets.
Prints each round's figures, then per algorithm each side's median and gymflow's ratio to each peer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gymflow.presets.validate import resolve_experiment
from gymflow.testing.rollouts import random_rollout

ENV = "HalfCheetah-v5"
FILL = 2000
BATCH = 256


@dataclass(frozen=True)
class Algorithm:
    name: str
    preset: str
    hidden: tuple[int, ...]


ALGORITHMS = {"sac": Algorithm("sac", "halfcheetah-sac", (256, 256)),
              "td3": Algorithm("td3", "hopper-td3", (400, 300))}


class Side:
    """Something that does N updates and says how many a second."""

    name: str

    def updates_per_second(self, updates: int) -> float:
        raise NotImplementedError

    def close(self) -> None:
        """Nothing to end by default."""


class Gymflow(Side):
    name = "gymflow"

    def __init__(self, algorithm: Algorithm, threads: int):
        torch.set_num_threads(threads)
        experiment = resolve_experiment(algorithm.preset, {"env.id": ENV, "distribution.learner_device": "cpu"})
        config = experiment.preset
        self.learner = experiment.algorithm.learner(config.agent, experiment.observation_space,
                                                    experiment.action_space, config.seed, "cpu")
        self.learner.insert([random_rollout(experiment.observation_space, experiment.action_space, FILL // 2, 2,
                                            np.random.default_rng(0))])
        self.learner.train(64, 0.0)  # warm-up: allocations, the optimisers' states

    def updates_per_second(self, updates: int) -> float:
        started = time.perf_counter()
        self.learner.train(updates, 0.0)
        return updates / (time.perf_counter() - started)


class Sbx(Side):
    name = "SBX"

    def __init__(self, algorithm: Algorithm, threads: int, python: str):
        script = Path(__file__).with_name("sbx_side.py")
        self.process = subprocess.Popen(
            [python, str(script), "--algo", algorithm.name, "--env", ENV, "--batch", str(BATCH), "--hidden",
             *map(str, algorithm.hidden), "--fill", str(FILL), "--threads", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        ready = self.process.stdout.readline().strip()
        if ready != "ready":
            raise SystemExit(f"--sbx-python: {python} {script} did not start (it said {ready!r}); "
                             "its venv: see benchmarks/sbx_side.py")

    def updates_per_second(self, updates: int) -> float:
        self.process.stdin.write(f"{updates}\n")
        self.process.stdin.flush()
        return float(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(30)


class StableBaselines3(Side):
    name = "SB3"

    def __init__(self, algorithm: Algorithm, threads: int):
        from stable_baselines3 import SAC, TD3
        from stable_baselines3.common.noise import NormalActionNoise

        torch.set_num_threads(threads)
        common = dict(buffer_size=1_000_000, learning_starts=FILL, batch_size=BATCH, tau=0.005, gamma=0.99,
                      train_freq=1, gradient_steps=1, policy_kwargs={"net_arch": list(algorithm.hidden)}, seed=0,
                      device="cpu", verbose=0)
        if algorithm.name == "sac":
            self.model = SAC("MlpPolicy", ENV, learning_rate=3e-4, ent_coef="auto", **common)
        else:
            noise = NormalActionNoise(np.zeros(6), 0.1 * np.ones(6))
            self.model = TD3("MlpPolicy", ENV, learning_rate=1e-3, policy_delay=2, target_policy_noise=0.2,
                             target_noise_clip=0.5, action_noise=noise, **common)
        self.model.learn(FILL)  # collects only: learning_starts is the fill
        self.updates_per_second(64)

    def updates_per_second(self, updates: int) -> float:
        started = time.perf_counter()
        for _ in range(updates):
            self.model.train(gradient_steps=1, batch_size=BATCH)
        return updates / (time.perf_counter() - started)


def race(sides: list[Side], rounds: int, updates: int, say: Callable[[str], None]) -> dict[str, list[float]]:
    """Each side's updates a second, round by round, the order turning each round (the VM drifts)."""
    figures: dict[str, list[float]] = {side.name: [] for side in sides}
    for index in range(rounds):
        order = sides[index % len(sides):] + sides[:index % len(sides)]
        for side in order:
            figures[side.name].append(side.updates_per_second(updates))
        say(f"  round {index}: " + ", ".join(f"{name} {values[-1]:.1f}" for name, values in figures.items()))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", nargs="+", choices=sorted(ALGORITHMS), default=["sac", "td3"])
    parser.add_argument("--peers", nargs="+", choices=["sbx", "sb3"], default=["sbx", "sb3"])
    parser.add_argument("--sbx-python", default=os.environ.get("SBX_PYTHON", "/tmp/sbx-venv/bin/python"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--updates", type=int, default=256, help="updates a side a round")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} threads a side")
    summary = []
    for name in args.algorithms:
        algorithm = ALGORITHMS[name]
        sides: list[Side] = [Gymflow(algorithm, args.threads)]
        if "sbx" in args.peers:
            sides.append(Sbx(algorithm, args.threads, args.sbx_python))
        if "sb3" in args.peers:
            sides.append(StableBaselines3(algorithm, args.threads))
        print(f"{name} on {ENV} ({'x'.join(map(str, algorithm.hidden))}, batch {BATCH}), updates/s:", flush=True)
        try:
            figures = race(sides, args.rounds, args.updates, lambda line: print(line, flush=True))
        finally:
            for side in sides:
                side.close()
        medians = {side: statistics.median(values) for side, values in figures.items()}
        ratios = ", ".join(f"gymflow / {side} {medians['gymflow'] / value:.2f}"
                           for side, value in medians.items() if side != "gymflow")
        summary.append(f"{name}: " + ", ".join(f"{side} {value:.1f}" for side, value in medians.items())
                       + f" (medians of {args.rounds}); {ratios}")
    print("\n".join(summary))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
