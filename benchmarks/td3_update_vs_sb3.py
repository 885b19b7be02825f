"""One TD3 gradient step on Hopper-v5's shapes (rl-zoo's settings: 400x300, batch 256, policy
delay 2): gymflow's learner against Stable-Baselines3's `TD3.train`, the two alternating.

    .venv/bin/pip install -e ".[bench,mujoco]"
    .venv/bin/python benchmarks/td3_update_vs_sb3.py --rounds 3 --steps 300

Both sample from a replay memory of 2,000 transitions (gymflow: random ones; SB3: collected by
its own `learn`) and run on the CPU with 2 torch threads. Prints ms a step for each side and
round, then the medians and their ratio gymflow / SB3.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import gymnasium as gym
import numpy as np
import torch

from gymflow.agents.batches import Rollout
from gymflow.agents.td3 import TD3Learner
from gymflow.presets.load import load_preset

WARM_UP_STEPS = 30


def gymflow_learner() -> TD3Learner:
    env = gym.make("Hopper-v5")
    learner = TD3Learner(load_preset("hopper-td3").agent, env.observation_space, env.action_space, seed=0)
    steps, obs_size = 2000, env.observation_space.shape[0]
    rng = np.random.default_rng(0)
    obs = rng.standard_normal((steps, 1, obs_size)).astype(np.float32)
    learner.insert([Rollout(
        obs=obs, actions=rng.uniform(-1, 1, (steps, 1, 3)).astype(np.float32),
        rewards=rng.standard_normal((steps, 1)).astype(np.float32), terminated=np.zeros((steps, 1), bool),
        truncated=np.zeros((steps, 1), bool), done_index=np.zeros(0, np.int64),
        done_obs=np.zeros((0, obs_size), np.float32), last_obs=obs[-1], log_probs=np.zeros((steps, 1), np.float32),
    )])
    learner.train(WARM_UP_STEPS, 0.0)
    return learner


def sb3_model():
    from stable_baselines3 import TD3
    from stable_baselines3.common.noise import NormalActionNoise

    model = TD3("MlpPolicy", gym.make("Hopper-v5"), learning_rate=1e-3, batch_size=256, learning_starts=0,
                policy_kwargs={"net_arch": [400, 300]}, action_noise=NormalActionNoise(np.zeros(3), 0.1 * np.ones(3)),
                train_freq=1, gradient_steps=1, policy_delay=2, verbose=0, device="cpu", seed=0)
    model.learn(2000)
    model.train(gradient_steps=WARM_UP_STEPS, batch_size=256)
    return model


def ms_per_step(step: Callable[[int], object], steps: int) -> float:
    started = time.perf_counter()
    step(steps)
    return (time.perf_counter() - started) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300, help="gradient steps a side a round")
    args = parser.parse_args()
    torch.set_num_threads(2)
    learner, model = gymflow_learner(), sb3_model()
    ours, theirs = [], []
    for round_index in range(args.rounds):  # alternate which side goes first: the VM drifts
        sides = [("gymflow", ours, lambda n: learner.train(n, 0.0)),
                 ("SB3", theirs, lambda n: model.train(gradient_steps=n, batch_size=256))]
        for name, figures, step in sides if round_index % 2 == 0 else sides[::-1]:
            figures.append(ms_per_step(step, args.steps))
            print(f"round {round_index}: {name} {figures[-1]:.2f} ms a step", flush=True)
    print(f"median: gymflow {statistics.median(ours):.2f} ms, SB3 {statistics.median(theirs):.2f} ms, "
          f"ratio {statistics.median(ours) / statistics.median(theirs):.2f}")


if __name__ == "__main__":
    main()
