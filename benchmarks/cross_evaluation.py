"""A policy trained on one env backend, scored on every backend: the C++ backends give the same task.

    .venv/bin/python benchmarks/cross_evaluation.py --preset breakout-ppo --env-steps 150000 --seeds 1 2 \
        --trained-on ale gymnasium --games 16

Each training run is the whole pipeline (Prefect flow, Dask LocalCluster, storage, MLflow) on the preset's
settings; only the seed, the budget, `env.backend` and the stores change. The run's delivered policy is then
played greedily, `--games` whole games (one an env, seeded alike), on Gymnasium's Python path (what a run's
evaluations play) and on each C++ backend installed, under the evaluation's preprocessing (unclipped scores).
The baseline is the Gymnasium path's score of the same policy: a ratio near 1 says the backend is the task
Gymnasium's evaluation scores (the no-op starts differ, so games differ; FIRE is served alike).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile

import numpy as np

BACKENDS = ("gymnasium", "ale", "envpool")


def delivered_policy(storage_root: str, run_id: str, version: int):
    """The greedy policy of version `version` of a stored run."""
    from gymflow.agents.algorithms import algorithm_of
    from gymflow.agents.networks import network_of_version
    from gymflow.envs.make import env_spaces
    from gymflow.presets.load import validate_preset_data
    from gymflow.tasks.storage.checkpoints import POLICY_BLOB, read_policy
    from gymflow.tasks.storage.codec import decode_tensors
    from gymflow.tasks.storage.layout import RunLayout
    from gymflow.tasks.storage.objects import Storage, StorageLocation
    from gymflow.tasks.storage.records import read_stored_preset

    storage = Storage(StorageLocation(storage_root))
    preset = validate_preset_data(read_stored_preset(storage, run_id))
    algorithm = algorithm_of(preset.agent)
    observation_space, action_space = env_spaces(preset.env.id, preset.env.kwargs,
                                                 preset.env.preprocessing().evaluation())
    weights = decode_tensors(read_policy(storage, RunLayout(run_id), version, [POLICY_BLOB])[POLICY_BLOB])
    network = network_of_version(weights, None, lambda: algorithm.network(preset.agent, observation_space,
                                                                          action_space))
    return preset, algorithm.policy(network, preset.agent, 0.0, 0)


def scores_on(backend: str, policy, preset, games: int, seed: int) -> list[float]:
    """`games` greedy games of `policy` on `backend`, one an env, from seed `seed`."""
    from gymflow.agents.rollout import evaluate
    from gymflow.envs.vector import make_vector_env

    env = make_vector_env(preset.env.id, dict(preset.env.kwargs), games, seed,
                          preset.env.preprocessing().evaluation(), backend)
    env.reset()
    returns = evaluate(policy, env).returns
    env.close()
    return [float(r) for r in returns]


def installed_backends() -> list[str]:
    from gymflow.envs.ale_backend import ale_vector_installed
    from gymflow.envs.envpool_backend import envpool_installed

    return [name for name, there in zip(BACKENDS, (True, ale_vector_installed(), envpool_installed())) if there]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="breakout-ppo")
    parser.add_argument("--env-steps", type=int, default=150_000)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--trained-on", nargs="+", default=["ale", "gymnasium"], choices=BACKENDS)
    parser.add_argument("--games", type=int, default=16)
    args = parser.parse_args()

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "0")
    from gymflow.flows.improve import improve

    scored_on = installed_backends()
    rows = []  # (trained on, seed, delivered version, {backend: mean return})
    with tempfile.TemporaryDirectory() as folder:
        root = os.path.join(folder, "data")
        for seed in args.seeds:
            for trained_on in args.trained_on:
                overrides = {"seed": seed, "schedule.total_env_steps": args.env_steps, "env.backend": trained_on,
                             "schedule.evaluate_every_env_steps": args.env_steps, "storage.root": root,
                             "tracking.tracking_uri": f"sqlite:///{os.path.join(folder, 'mlflow.db')}"}
                summary = improve(args.preset, overrides)
                preset, policy = delivered_policy(root, summary.run_id, summary.delivered_version)
                means = {backend: statistics.mean(scores_on(backend, policy, preset, args.games, 10_000 + seed))
                         for backend in scored_on}
                rows.append((trained_on, seed, summary.delivered_version, means))
                print(f"trained on {trained_on}, seed {seed}: v{summary.delivered_version}, "
                      + ", ".join(f"{name} {mean:.2f}" for name, mean in means.items()), flush=True)

    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"{args.preset}, {args.env_steps:,} env steps a run, greedy, {args.games} games a backend (mean return)")
    print(f"{'trained on':<11} {'seed':>4} {'version':>7} " + " ".join(f"{name:>10}" for name in scored_on))
    for trained_on, seed, version, means in rows:
        print(f"{trained_on:<11} {seed:>4} {version:>7} " + " ".join(f"{means[name]:>10.2f}" for name in scored_on))
    for other in scored_on[1:]:
        ratios = [means[other] / means["gymnasium"] for *_, means in rows if means["gymnasium"] > 0]
        print(f"{other} / gymnasium, median over runs: {np.median(ratios) if ratios else float('nan'):.2f}")


if __name__ == "__main__":
    main()
