"""The share of a whole `improve` run's training wall-clock not spent stepping envs or learning,
against a plain in-process loop doing the same work side by side.

    .venv/bin/python benchmarks/orchestration_overhead.py --presets cartpole-ppo cartpole-dqn --repeats 2

Each preset runs with its target return switched off, so both sides do exactly the preset's
budget of env steps and gradient steps. Baseline: one process, the same learner and the same
collection code (`agents.rollout.collect` over one SeededVectorEnv of all the preset's envs,
evaluation at the same cadence and of the final policy, as gymflow's run ends with the deciding
evaluation of its last version), nothing written, no Prefect, Dask, storage or MLflow. gymflow:
the `improve` flow on its embedded defaults (LocalCluster, local folder, MLflow SQLite, a
temporary Prefect API started before timing). Printed per run: the flow's own
`summary/orchestration_share` (its loop's wall-clock minus the time the rollout jobs stepped
envs, the learner learned and evaluation ran on the critical path) and the ratio of the two
loops' wall-clock. The target share is <= 10%. Runs alternate baseline / gymflow, because this
machine's per-core speed drifts by tens of percent within minutes, and each gymflow run is held
against the mean of the baseline runs just before and just after it (a drift in one direction
over the pair then favours neither side).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

import torch

BUDGETS = {"cartpole-ppo": 40_960, "cartpole-dqn": 20_000, "cartpole-dqn-async": 20_000, "pendulum-sac": 4_000}


def plain_loop(preset: str, total_env_steps: int) -> float:
    """Seconds the same training takes in one process with nothing around it."""
    from gymflow.agents.rollout import RandomPolicy, collect, evaluate
    from gymflow.envs.vector import SeededVectorEnv
    from gymflow.presets.validate import resolve_experiment
    from gymflow.tasks.training.learning import create_learner

    experiment = resolve_experiment(preset, {"schedule.total_env_steps": total_env_steps, "schedule.target_return": None})
    config, algorithm, schedule = experiment.preset, experiment.algorithm, experiment.preset.schedule
    learner = create_learner(experiment)
    torch.set_num_threads(config.distribution.learner_threads)
    env = SeededVectorEnv(config.env.id, dict(config.env.kwargs), config.envs_in_total, seed=0)
    env.reset()
    network = getattr(learner, "network", None) or getattr(learner, "q_network", None) or learner.actor
    started = time.perf_counter()
    steps, next_evaluation = 0, schedule.evaluate_every_env_steps
    if schedule.heatup_env_steps:

        rollout, _ = collect(RandomPolicy(env.action_space, 0), env, -(-schedule.heatup_env_steps // config.envs_in_total))
        learner.insert([rollout])
        steps += rollout.env_steps

    def evaluate_network() -> None:
        evaluation_env = SeededVectorEnv(config.env.id, dict(config.env.kwargs), schedule.evaluation_episodes, seed=1)
        evaluation_env.reset()
        evaluate(algorithm.policy(network, config.agent, 0.0, 0), evaluation_env)

    while steps < total_env_steps:
        policy = algorithm.policy(network, config.agent, algorithm.exploration(config.agent, steps), steps)
        rollout, _ = collect(policy, env, schedule.rollout_steps_per_env)
        if steps >= next_evaluation:
            next_evaluation += schedule.evaluate_every_env_steps
            evaluate_network()
        learner.learn([rollout], min(steps / total_env_steps, 1.0))
        steps += rollout.env_steps
    evaluate_network()  # the final policy's score, as gymflow's run ends with its deciding evaluation
    return time.perf_counter() - started


def gymflow_run(preset: str, total_env_steps: int, folder: str, mode: str = "sync", changes: dict | None = None):
    from gymflow.flows.improve import improve

    return improve(preset, {
        "schedule.total_env_steps": total_env_steps, "schedule.target_return": None, "distribution.mode": mode,
        "storage.root": os.path.join(folder, "data"), "tracking.tracking_uri": f"sqlite:///{os.path.join(folder, 'mlflow.db')}",
        **(changes or {}),
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["cartpole-ppo", "cartpole-dqn"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--mode", default="sync", choices=["single", "sync"], help="gymflow's distribution.mode")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a preset change for gymflow's side (repeatable), e.g. tracking.video=off")
    args = parser.parse_args()
    from gymflow.presets.load import parse_assignments

    changes = parse_assignments(args.set)

    from prefect.testing.utilities import prefect_test_harness

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "0")  # as gymflow's own temporary API: no telemetry
    rows = []
    with prefect_test_harness(server_startup_timeout=120), tempfile.TemporaryDirectory() as folder:
        for preset in args.presets:
            budget = BUDGETS.get(preset, 20_000)
            plains = [plain_loop(preset, budget)]
            for _ in range(args.repeats):  # plain, gymflow, plain, ..., plain: each gymflow run between two plain ones
                summary = gymflow_run(preset, budget, folder, args.mode, changes)
                plains.append(plain_loop(preset, budget))
                rows.append((preset, budget, (plains[-2] + plains[-1]) / 2, summary))

    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"gymflow in distribution.mode {args.mode}")
    print(f"{'preset':<18} {'env steps':>9} {'plain s':>8} {'gymflow s':>9} {'ratio':>6} {'orch share':>10}")
    for preset, _budget, plain, summary in rows:
        print(f"{preset:<18} {summary.env_steps:>9,} {plain:>8.1f} {summary.wall_seconds:>9.1f} "
              f"{summary.wall_seconds / plain:>6.2f} {100 * summary.orchestration_share:>9.1f}%")
    for preset in args.presets:
        mine = [(plain, summary) for p, _, plain, summary in rows if p == preset]
        share = statistics.median(s.orchestration_share for _, s in mine)
        ratio = statistics.median(s.wall_seconds / plain for plain, s in mine)
        print(f"{preset}: median orchestration share {100 * share:.1f}% (target <= 10%), "
              f"gymflow loop / plain loop {ratio:.2f}")


if __name__ == "__main__":
    main()
