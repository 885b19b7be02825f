"""MuJoCo continuous control: gymflow against Stable-Baselines3, same machine, same env, same
rl-zoo hyper-parameters, same env-step budget, the two sides alternating seed by seed.

    .venv/bin/pip install -e ".[bench,mujoco]"
    .venv/bin/python benchmarks/mujoco_vs_sb3.py hopper-ppo --steps 1000000 --seeds 0 1 2
    .venv/bin/python benchmarks/mujoco_vs_sb3.py halfcheetah-sac --steps 100000 --seeds 0 1 2

For each seed and side: the final greedy evaluation return (10 episodes; gymflow's own final
evaluation, SB3's `evaluate_policy` with the training run's observation statistics) and the
wall-clock of the whole run (gymflow: the `improve` call end to end, Dask cluster start-up,
storage, MLflow and artifacts included; the temporary Prefect API is started once before
timing. SB3: model construction plus `learn()`). Then medians and the ratio gymflow / SB3.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

EVALUATION_EPISODES = 10


@dataclass(frozen=True)
class Workload:
    env_id: str
    preset: str
    sb3: Callable[[int, int], tuple[float, float]]  # (seed, steps) -> (final greedy return, seconds)


def hopper_ppo_with_sb3(seed: int, steps: int) -> tuple[float, float]:
    """rl-zoo's Hopper-v3 PPO (hyperparams/ppo.yml) on Hopper-v5: VecNormalize, 1 env x 512."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.evaluation import evaluate_policy
    from stable_baselines3.common.vec_env import VecNormalize
    from torch import nn

    started = time.perf_counter()
    env = VecNormalize(make_vec_env("Hopper-v5", n_envs=1, seed=seed), gamma=0.999)
    model = PPO("MlpPolicy", env, n_steps=512, batch_size=32, gamma=0.999, learning_rate=9.80828e-05,
                ent_coef=0.00229519, clip_range=0.2, n_epochs=5, gae_lambda=0.99, max_grad_norm=0.7,
                vf_coef=0.835671, seed=seed, device="cpu", verbose=0,
                policy_kwargs={"log_std_init": -2, "ortho_init": False, "activation_fn": nn.ReLU,
                               "net_arch": {"pi": [256, 256], "vf": [256, 256]}})
    model.learn(steps)
    seconds = time.perf_counter() - started
    evaluation = VecNormalize(make_vec_env("Hopper-v5", n_envs=1, seed=seed + 1000), training=False,
                              norm_reward=False)
    evaluation.obs_rms = env.obs_rms  # the training run's statistics, frozen
    returns, _ = evaluate_policy(model, evaluation, n_eval_episodes=EVALUATION_EPISODES, deterministic=True)
    return float(returns), seconds


def halfcheetah_sac_with_sb3(seed: int, steps: int) -> tuple[float, float]:
    """rl-zoo's HalfCheetah-v3 SAC (hyperparams/sac.yml: SB3's defaults, learning_starts 10,000)."""
    from stable_baselines3 import SAC
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.evaluation import evaluate_policy

    started = time.perf_counter()
    model = SAC("MlpPolicy", make_vec_env("HalfCheetah-v5", n_envs=1, seed=seed), learning_starts=10_000,
                seed=seed, device="cpu", verbose=0)
    model.learn(steps)
    seconds = time.perf_counter() - started
    evaluation = make_vec_env("HalfCheetah-v5", n_envs=1, seed=seed + 1000)
    returns, _ = evaluate_policy(model, evaluation, n_eval_episodes=EVALUATION_EPISODES, deterministic=True)
    return float(returns), seconds


WORKLOADS = {
    "hopper-ppo": Workload("Hopper-v5", "hopper-ppo", hopper_ppo_with_sb3),
    "halfcheetah-sac": Workload("HalfCheetah-v5", "halfcheetah-sac", halfcheetah_sac_with_sb3),
}


def run_gymflow(preset: str, seed: int, steps: int, folder: str) -> tuple[float, float]:
    from gymflow.flows.improve import improve

    started = time.perf_counter()
    summary = improve(preset, {
        "seed": seed, "schedule.total_env_steps": steps, "schedule.evaluate_every_env_steps": steps,
        "schedule.evaluation_episodes": EVALUATION_EPISODES, "storage.root": os.path.join(folder, f"data-{seed}"),
        "tracking.tracking_uri": f"sqlite:///{folder}/mlflow.db", "tracking.artifact_location": f"{folder}/mlartifacts",
    })
    return summary.final_return, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--steps", type=int, required=True, help="env-step budget of every run")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    args = parser.parse_args()
    workload = WORKLOADS[args.workload]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        run_gymflow(workload.preset, 99, 2048 if "sac" not in workload.preset else 10_240, folder)  # Prefect API up
        for index, seed in enumerate(args.seeds):  # alternate which side goes first: the VM drifts
            if index % 2 == 0:
                ours = run_gymflow(workload.preset, seed, args.steps, folder)
                theirs = workload.sb3(seed, args.steps)
            else:
                theirs = workload.sb3(seed, args.steps)
                ours = run_gymflow(workload.preset, seed, args.steps, folder)
            rows.append((seed, ours, theirs))
            print(f"seed {seed}: gymflow {ours[0]:.1f} in {ours[1]:.0f} s, SB3 {theirs[0]:.1f} in {theirs[1]:.0f} s",
                  flush=True)
    print(f"\nmachine: {os.cpu_count()} cores; {workload.env_id}, {args.workload}, {args.steps:,} env steps, "
          f"final greedy return over {EVALUATION_EPISODES} episodes")
    print(f"{'seed':>4} {'gymflow return':>15} {'s':>7}   {'SB3 return':>11} {'s':>7}   {'time ratio':>10}")
    for seed, (g_return, g_s), (b_return, b_s) in rows:
        print(f"{seed:>4} {g_return:>15.1f} {g_s:>7.0f}   {b_return:>11.1f} {b_s:>7.0f}   {g_s / b_s:>10.2f}")
    g_return = statistics.median(row[1][0] for row in rows)
    b_return = statistics.median(row[2][0] for row in rows)
    g_s, b_s = statistics.median(row[1][1] for row in rows), statistics.median(row[2][1] for row in rows)
    print(f"median: gymflow {g_return:.1f} in {g_s:.0f} s, Stable-Baselines3 {b_return:.1f} in {b_s:.0f} s; "
          f"time ratio {g_s / b_s:.2f} (target <= 1), returns spread gymflow "
          f"{min(r[1][0] for r in rows):.0f}..{max(r[1][0] for r in rows):.0f}, SB3 "
          f"{min(r[2][0] for r in rows):.0f}..{max(r[2][0] for r in rows):.0f}")


if __name__ == "__main__":
    main()
