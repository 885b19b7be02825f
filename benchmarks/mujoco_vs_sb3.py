"""MuJoCo continuous control: gymflow against Stable-Baselines3, same machine, same env, same
hyper-parameters (the preset's), same env-step budget, the two sides alternating seed by seed.

    .venv/bin/pip install -e ".[bench,mujoco]"
    .venv/bin/python benchmarks/mujoco_vs_sb3.py hopper-ppo --steps 1000000 --seeds 0 1 2
    .venv/bin/python benchmarks/mujoco_vs_sb3.py halfcheetah-sac --steps 100000 --seeds 0 1 2
    .venv/bin/python benchmarks/mujoco_vs_sb3.py hopper-td3 --steps 300000 --seeds 0 1 2 \
        --record benchmarks/records/hopper-td3-300000.jsonl

With `--record FILE`, each finished run is appended to FILE as one JSON line (a side of a seed),
runs already there are not run again, and the table covers every seed with both sides in it: a
long comparison can be run a seed at a time (or continue after a kill) and still be reported as
one. `--only sb3` (or `gymflow`) runs one side alone; its figures are then not alternated with the
other side's and its times say less.

For each seed and side: the final greedy evaluation return (10 episodes; gymflow's own final
evaluation, SB3's `evaluate_policy` with the training run's observation statistics) and the
wall-clock of the whole run (gymflow: the `improve` call end to end, Dask cluster start-up,
storage, MLflow and artifacts included; the temporary Prefect API is started once before
timing. SB3: model construction plus `learn()`). Then medians and the ratio gymflow / SB3.
"""

from __future__ import annotations

import argparse
import json
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
    """The mujoco-ppo settings (presets/builtin/mujoco-ppo.yaml) in SB3: VecNormalize (observations
    and rewards, clipped at 10), 8 envs x 256, 10 epochs of 64, lr 3e-4 annealed to 0, tanh 64x64
    with orthogonal init, log-std -0.5, value weight 0.25, advantages not normalised."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.evaluation import evaluate_policy
    from stable_baselines3.common.vec_env import VecNormalize
    from torch import nn

    started = time.perf_counter()
    env = VecNormalize(make_vec_env("Hopper-v5", n_envs=8, seed=seed), gamma=0.99)
    model = PPO("MlpPolicy", env, n_steps=256, batch_size=64, gamma=0.99, learning_rate=lambda left: 3e-4 * left,
                ent_coef=0.0, clip_range=0.2, n_epochs=10, gae_lambda=0.95, max_grad_norm=0.5, vf_coef=0.25,
                normalize_advantage=False, seed=seed, device="cpu", verbose=0,
                policy_kwargs={"log_std_init": -0.5, "ortho_init": True, "activation_fn": nn.Tanh,
                               "net_arch": {"pi": [64, 64], "vf": [64, 64]}})
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


def hopper_td3_with_sb3(seed: int, steps: int) -> tuple[float, float]:
    """rl-zoo's Hopper-v3 TD3 (hyperparams/td3.yml): 400x300, lr 1e-3, batch 256, Gaussian action
    noise 0.1, learning_starts 10,000, one gradient step per env step."""
    import numpy as np
    from stable_baselines3 import TD3
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.evaluation import evaluate_policy
    from stable_baselines3.common.noise import NormalActionNoise

    started = time.perf_counter()
    env = make_vec_env("Hopper-v5", n_envs=1, seed=seed)
    actions = env.action_space.shape[0]
    model = TD3("MlpPolicy", env, learning_rate=1e-3, buffer_size=1_000_000, learning_starts=10_000, batch_size=256,
                tau=0.005, gamma=0.99, train_freq=1, gradient_steps=1, policy_delay=2, target_policy_noise=0.2,
                target_noise_clip=0.5, action_noise=NormalActionNoise(np.zeros(actions), 0.1 * np.ones(actions)),
                policy_kwargs={"net_arch": [400, 300]}, seed=seed, device="cpu", verbose=0)
    model.learn(steps)
    seconds = time.perf_counter() - started
    evaluation = make_vec_env("Hopper-v5", n_envs=1, seed=seed + 1000)
    returns, _ = evaluate_policy(model, evaluation, n_eval_episodes=EVALUATION_EPISODES, deterministic=True)
    return float(returns), seconds


WORKLOADS = {
    "hopper-ppo": Workload("Hopper-v5", "hopper-ppo", hopper_ppo_with_sb3),
    "halfcheetah-sac": Workload("HalfCheetah-v5", "halfcheetah-sac", halfcheetah_sac_with_sb3),
    "hopper-td3": Workload("Hopper-v5", "hopper-td3", hopper_td3_with_sb3),
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


Row = tuple[int, tuple[float, float], tuple[float, float]]  # seed, gymflow's (return, s), SB3's (return, s)
SIDES = ("gymflow", "sb3")
Results = dict[int, dict[str, tuple[float, float]]]  # seed -> side -> (return, seconds)


def recorded_results(record: str | None, workload: str, steps: int) -> Results:
    """The runs `record` holds for this workload and budget, side by side: one line a side (older
    files: one line a seed with both)."""
    results: Results = {}
    if record is None or not os.path.exists(record):
        return results
    with open(record) as lines:
        entries = [json.loads(line) for line in lines if line.strip()]
    for entry in entries:
        if entry["workload"] == workload and entry["steps"] == steps:
            sides = {entry["side"]: entry["result"]} if "side" in entry else {side: entry[side] for side in SIDES}
            results.setdefault(entry["seed"], {}).update({side: tuple(result) for side, result in sides.items()})
    return results


def record_side(record: str, workload: str, steps: int, seed: int, side: str, result: tuple[float, float]) -> None:
    os.makedirs(os.path.dirname(record) or ".", exist_ok=True)
    entry = {"workload": workload, "steps": steps, "seed": seed, "side": side, "result": list(result),
             "date": time.strftime("%Y-%m-%d %H:%M"), "cores": os.cpu_count()}
    with open(record, "a") as lines:
        lines.write(json.dumps(entry) + "\n")


def run_seeds(workload: Workload, seeds: list[int], steps: int, record: str | None, results: Results,
              sides: tuple[str, ...] = SIDES) -> None:
    """Run each seed's `sides` that `results` lacks, adding them to it (and to `record` as each ends)."""
    with tempfile.TemporaryDirectory() as folder:
        run = {"gymflow": lambda seed: run_gymflow(workload.preset, seed, steps, folder),
               "sb3": lambda seed: workload.sb3(seed, steps)}
        if "gymflow" in sides and any("gymflow" not in results.get(seed, {}) for seed in seeds):
            run_gymflow(workload.preset, 99, 2048 if "ppo" in workload.preset else 10_240, folder)  # Prefect API up
        for seed in seeds:  # alternate which side goes first (by the seed's parity): the VM drifts
            for side in SIDES if seed % 2 == 0 else SIDES[::-1]:
                if side not in sides or side in results.get(seed, {}):
                    continue
                results.setdefault(seed, {})[side] = run[side](seed)
                if record is not None:
                    record_side(record, workload.preset, steps, seed, side, results[seed][side])
                print(f"seed {seed}: {side} {results[seed][side][0]:.1f} in {results[seed][side][1]:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--steps", type=int, required=True, help="env-step budget of every run")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--record", help="a JSON-lines file: each finished run is kept there and not run again")
    parser.add_argument("--only", choices=SIDES, help="run this side alone (its seeds' other side recorded, or later)")
    args = parser.parse_args()
    workload = WORKLOADS[args.workload]
    results = recorded_results(args.record, args.workload, args.steps)
    run_seeds(workload, args.seeds, args.steps, args.record, results, SIDES if args.only is None else (args.only,))
    rows = sorted((seed, sides["gymflow"], sides["sb3"]) for seed, sides in results.items() if len(sides) == 2)
    report(workload, args.workload, args.steps, rows)


def report(workload: Workload, name: str, steps: int, rows: list[Row]) -> None:
    print(f"\nmachine: {os.cpu_count()} cores; {workload.env_id}, {name}, {steps:,} env steps, "
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
