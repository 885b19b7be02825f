"""Time to solve CartPole-v1 (greedy evaluation mean >= 475): gymflow's whole pipeline against
Stable-Baselines3 PPO with rl-zoo's hyper-parameters, same machine, several seeds, medians.

    .venv/bin/pip install -e ".[bench]"      # stable-baselines3, benchmark-only
    .venv/bin/python benchmarks/vs_sb3.py --seeds 0 1 2

Both evaluate 10 greedy episodes every 4,096 env steps and stop at 475. gymflow's time is the
`improve` call end to end (Dask cluster start-up, storage, MLflow, artifacts included; the
temporary Prefect API is started once before timing). SB3's time is model construction plus
`learn()` with an EvalCallback. Ratio = gymflow / SB3 (below 1: gymflow is faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

RL_ZOO_PPO_CARTPOLE = {
    "n_steps": 32, "batch_size": 256, "gae_lambda": 0.8, "gamma": 0.98, "n_epochs": 20, "ent_coef": 0.0,
}
N_ENVS, BUDGET, EVAL_EVERY, TARGET = 8, 100_000, 4096, 475.0


def solve_with_sb3(seed: int) -> tuple[float, int, bool]:
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import EvalCallback, StopTrainingOnRewardThreshold
    from stable_baselines3.common.env_util import make_vec_env

    started = time.perf_counter()
    env = make_vec_env("CartPole-v1", n_envs=N_ENVS, seed=seed)
    stop = StopTrainingOnRewardThreshold(reward_threshold=TARGET, verbose=0)
    evaluation = EvalCallback(make_vec_env("CartPole-v1", n_envs=1, seed=seed + 1000), n_eval_episodes=10,
                              eval_freq=EVAL_EVERY // N_ENVS, deterministic=True, callback_on_new_best=stop, verbose=0)
    def linear(start):
        return lambda progress: progress * start
    model = PPO("MlpPolicy", env, learning_rate=linear(0.001), clip_range=linear(0.2), seed=seed, verbose=0,
                device="cpu", **RL_ZOO_PPO_CARTPOLE)
    model.learn(BUDGET, callback=evaluation)
    solved = evaluation.best_mean_reward >= TARGET
    return time.perf_counter() - started, model.num_timesteps, solved


def solve_with_gymflow(seed: int, folder: str) -> tuple[float, int, bool]:
    from gymflow.flows.improve import improve

    started = time.perf_counter()
    summary = improve("cartpole-ppo", {
        "seed": seed, "schedule.total_env_steps": BUDGET, "schedule.evaluate_every_env_steps": EVAL_EVERY,
        "storage.root": os.path.join(folder, "data"), "tracking.tracking_uri": f"sqlite:///{folder}/mlflow.db",
        "tracking.artifact_location": f"{folder}/mlartifacts",
    })
    return time.perf_counter() - started, summary.env_steps, summary.solved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        solve_with_gymflow(99, folder)  # start the temporary Prefect API once, outside the timings
        for seed in args.seeds:
            rows.append((seed, solve_with_gymflow(seed, folder), solve_with_sb3(seed)))
    print(f"\nmachine: {os.cpu_count()} cores; CartPole-v1 to a greedy mean of {TARGET:g}")
    print(f"{'seed':>4} {'gymflow s':>10} {'steps':>8} {'solved':>6}   {'SB3 s':>7} {'steps':>8} {'solved':>6}   {'ratio':>5}")
    for seed, (g_s, g_steps, g_ok), (b_s, b_steps, b_ok) in rows:
        print(f"{seed:>4} {g_s:>10.1f} {g_steps:>8,} {g_ok!s:>6}   {b_s:>7.1f} {b_steps:>8,} {b_ok!s:>6}   {g_s / b_s:>5.2f}")
    g = statistics.median(r[1][0] for r in rows)
    b = statistics.median(r[2][0] for r in rows)
    print(f"median: gymflow {g:.1f} s, Stable-Baselines3 {b:.1f} s, ratio {g / b:.2f} (target <= 1)")


if __name__ == "__main__":
    main()
