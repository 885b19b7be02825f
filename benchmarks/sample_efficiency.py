"""Environment steps and time gymflow takes to reach each preset's target return, per seed.

    .venv/bin/python benchmarks/sample_efficiency.py --presets cartpole-ppo cartpole-dqn --seeds 0 1 2
    .venv/bin/python benchmarks/sample_efficiency.py --presets cartpole-dqn-async pendulum-sac --seeds 0 1 2
    .venv/bin/python benchmarks/sample_efficiency.py --presets cartpole-ppo cartpole-appo catch-ppo catch-appo --seeds 0 1 2 3 4
    .venv/bin/python benchmarks/sample_efficiency.py --presets lunarlander-ppo --seeds 0   # Box2D: pip install -e ".[box2d]"

Each run is the whole pipeline (Prefect flow, Dask LocalCluster, storage, MLflow) on the
preset's default settings; only the seed, storage and MLflow store change. The baseline beside
each figure is rl-zoo's published budget for the same algorithm (CartPole: PPO within 100k
steps, DQN within 50k; Pendulum: SAC within 20k; LunarLander: PPO >= 200 within 1M; APPO is held to PPO's), so the
ratio is gymflow's steps over that budget (below 1 is better; Catch, gymflow's own env, has none). ASYNC runs also print
their policy lag and dropped shards.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

RL_ZOO_BUDGET = {"cartpole-ppo": 100_000, "cartpole-appo": 100_000, "cartpole-dqn": 50_000, "cartpole-dqn-async": 50_000, "pendulum-sac": 20_000,
                 "lunarlander-ppo": 1_000_000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["cartpole-ppo", "cartpole-dqn"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    args = parser.parse_args()

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "0")  # as gymflow's own temporary API: no telemetry
    from gymflow.flows.improve import improve

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for preset in args.presets:
            for seed in args.seeds:
                overrides = {
                    "seed": seed,
                    "storage.root": os.path.join(folder, "data"),
                    "tracking.tracking_uri": f"sqlite:///{os.path.join(folder, 'mlflow.db')}",
                }
                started = time.perf_counter()
                summary = improve(preset, overrides)
                rows.append((preset, seed, summary, time.perf_counter() - started,
                             _first_reaching(overrides["tracking.tracking_uri"], summary)))

    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"{'preset':<18} {'seed':>4} {'solved':>6} {'eval':>7} {'env steps':>10} {'x rl-zoo':>8} {'reached at':>10} "
          f"{'train s':>8} {'total s':>8} {'orch %':>6} {'lag mean':>8} {'lag max':>7} {'dropped':>7}")
    for preset, seed, summary, total, reached in rows:
        lag = (f"{summary.policy_lag_mean:>8.2f} {summary.policy_lag_max:>7} {summary.shards_dropped:>7}"
               if summary.shards_inserted else f"{'-':>8} {'-':>7} {'-':>7}")
        print(f"{preset:<18} {seed:>4} {summary.solved!s:>6} {summary.final_return:>7.1f} {summary.env_steps:>10,} "
              f"{summary.env_steps / RL_ZOO_BUDGET.get(preset, float('nan')):>8.2f} {reached or float('nan'):>10,.0f} "
              f"{summary.wall_seconds:>8.1f} "
              f"{total:>8.1f} {100 * summary.orchestration_share:>6.1f} {lag}")
    for preset in args.presets:
        mine = [(s, t) for p, _, s, t, _ in rows if p == preset]
        steps = statistics.median(s.env_steps for s, _ in mine)
        reached = [r for p, _, _, _, r in rows if p == preset and r is not None]
        print(f"{preset}: median {steps:,.0f} env steps ({steps / RL_ZOO_BUDGET.get(preset, float('nan')):.2f} of rl-zoo's "
              f"budget), median {statistics.median(s.wall_seconds for s, _ in mine):.1f} s training, "
              f"{statistics.median(t for _, t in mine):.1f} s end to end, "
              f"solved {sum(s.solved for s, _ in mine)}/{len(mine)}"
              + (f", the target first reached by the version of median {statistics.median(reached):,.0f} env steps"
                 if reached else ""))


def _first_reaching(tracking_uri: str, summary) -> float | None:
    """The env steps of the first version whose evaluation reached the target: an ASYNC run's
    evaluations finish while it trains on, so it stops later than the version that reached it."""
    from mlflow.tracking import MlflowClient

    from gymflow.presets.load import load_preset

    target = load_preset(summary.run_id.rsplit("-", 3)[0]).schedule.target_return
    history = MlflowClient(tracking_uri).get_metric_history(summary.mlflow_run_id, "eval/return_mean")
    reached = sorted(m.step for m in history if target is not None and m.value >= target)
    return float(reached[0]) if reached else None


if __name__ == "__main__":
    main()
