"""Recurrent PPO on CartPole without its velocities: gymflow's `cartpole-po-ppo` against
sb3-contrib's RecurrentPPO at the same settings (rl-zoo's ppo_lstm hyper-parameters for
CartPoleNoVel-v1), the same env-step budget, the two sides alternating seed by seed.

    .venv/bin/pip install -e ".[bench]"
    .venv/bin/python benchmarks/recurrent_vs_sb3_contrib.py --steps 100000 --seeds 0 1 2

The env: CartPole-v1 with the cart's velocity and the pole's angular velocity left out (gymflow's
`env.hide: [1, 3]`; the same wrapper here for sb3-contrib, as rl-zoo's CartPoleNoVel-v1). Both
sides: 8 envs x 32 steps a round, 20 epochs of minibatches of 256, lr 1e-3 and clip range 0.2
annealed to 0, gamma 0.98, lambda 0.8, no entropy bonus, ReLU, an LSTM of 64 units, observations
and rewards normalised, one torch thread. What differs is each library's shape: sb3-contrib puts
an LSTM of its own before each head's [64] layer (`enable_critic_lstm`); gymflow puts one [64]
layer before one LSTM shared by both heads.
gymflow runs the preset as a user would (`improve`, a SYNC run: its Dask worker, storage, MLflow),
its early stop at the target return turned off so that both use the whole budget.

For each seed and side: the final greedy evaluation return (10 episodes; gymflow's own final
evaluation, sb3-contrib's `evaluate_policy` with the training run's observation statistics) and
the wall-clock of the whole run (gymflow: the `improve` call end to end; the temporary Prefect API
is started once before timing. sb3-contrib: model construction plus `learn()`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import gymnasium as gym
import numpy as np

EVALUATION_EPISODES = 10
HIDDEN = [1, 3]  # CartPole's velocities: what env.hide leaves out in the preset


class WithoutVelocities(gym.ObservationWrapper):
    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.kept = [i for i in range(env.observation_space.shape[0]) if i not in HIDDEN]
        box = env.observation_space
        self.observation_space = gym.spaces.Box(box.low[self.kept], box.high[self.kept], dtype=box.dtype)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return observation[self.kept]


def run_sb3_contrib(seed: int, steps: int) -> tuple[float, float]:
    import torch
    from sb3_contrib import RecurrentPPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.evaluation import evaluate_policy
    from stable_baselines3.common.vec_env import VecNormalize
    from torch import nn

    torch.set_num_threads(1)
    started = time.perf_counter()
    env = VecNormalize(make_vec_env("CartPole-v1", n_envs=8, seed=seed, wrapper_class=WithoutVelocities), gamma=0.98)
    model = RecurrentPPO("MlpLstmPolicy", env, n_steps=32, batch_size=256, gamma=0.98, gae_lambda=0.8, n_epochs=20,
                         ent_coef=0.0, learning_rate=lambda left: 1e-3 * left, clip_range=lambda left: 0.2 * left,
                         seed=seed, device="cpu", verbose=0,
                         policy_kwargs={"ortho_init": False, "activation_fn": nn.ReLU, "lstm_hidden_size": 64,
                                        "enable_critic_lstm": True, "net_arch": {"pi": [64], "vf": [64]}})
    model.learn(steps)
    seconds = time.perf_counter() - started
    evaluation = VecNormalize(make_vec_env("CartPole-v1", n_envs=1, seed=seed + 1000, wrapper_class=WithoutVelocities),
                              training=False, norm_reward=False)
    evaluation.obs_rms = env.obs_rms  # the training run's statistics, frozen
    returns, _ = evaluate_policy(model, evaluation, n_eval_episodes=EVALUATION_EPISODES, deterministic=True)
    return float(returns), seconds


def run_gymflow(seed: int, steps: int, folder: str) -> tuple[float, float]:
    from gymflow.flows.improve import improve

    started = time.perf_counter()
    summary = improve("cartpole-po-ppo", {
        "seed": seed, "schedule.total_env_steps": steps, "schedule.evaluate_every_env_steps": steps,
        "schedule.evaluation_episodes": EVALUATION_EPISODES, "schedule.target_return": None,
        "storage.root": os.path.join(folder, f"data-{seed}"), "tracking.tracking_uri": f"sqlite:///{folder}/mlflow.db",
        "tracking.artifact_location": f"{folder}/mlartifacts",
    })
    return summary.final_return, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100_000, help="env-step budget of every run")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        run_gymflow(99, 2048, folder)  # the temporary Prefect API up, imports warm
        for seed in args.seeds:  # alternate which side goes first (by the seed's parity): the VM drifts
            if seed % 2 == 0:
                ours, theirs = run_gymflow(seed, args.steps, folder), run_sb3_contrib(seed, args.steps)
            else:
                theirs = run_sb3_contrib(seed, args.steps)
                ours = run_gymflow(seed, args.steps, folder)
            rows.append((seed, ours, theirs))
            print(f"seed {seed}: gymflow {ours[0]:.1f} in {ours[1]:.0f} s, sb3-contrib {theirs[0]:.1f} in "
                  f"{theirs[1]:.0f} s", flush=True)
    report(args.steps, rows)


def report(steps: int, rows: list[tuple[int, tuple[float, float], tuple[float, float]]]) -> None:
    print(f"\nmachine: {os.cpu_count()} cores; CartPole-v1 without velocities, {steps:,} env steps, "
          f"final greedy return over {EVALUATION_EPISODES} episodes")
    print(f"{'seed':>4} {'gymflow return':>15} {'s':>6}   {'sb3-contrib return':>18} {'s':>6}   {'time ratio':>10}")
    for seed, (g_return, g_s), (b_return, b_s) in rows:
        print(f"{seed:>4} {g_return:>15.1f} {g_s:>6.0f}   {b_return:>18.1f} {b_s:>6.0f}   {g_s / b_s:>10.2f}")
    g_return, b_return = (statistics.median(row[side][0] for row in rows) for side in (1, 2))
    g_s, b_s = (statistics.median(row[side][1] for row in rows) for side in (1, 2))
    print(f"median: gymflow {g_return:.1f} in {g_s:.0f} s, sb3-contrib {b_return:.1f} in {b_s:.0f} s; "
          f"time ratio {g_s / b_s:.2f} (target <= 1)")


if __name__ == "__main__":
    main()
