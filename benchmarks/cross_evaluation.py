"""A policy trained on one env backend, scored on every backend: the C++ backends give the same task.

    .venv/bin/python benchmarks/cross_evaluation.py --preset breakout-ppo --env-steps 150000 --seeds 1 2 \
        --trained-on ale gymnasium --games 64 --root /tmp/cross
    .venv/bin/python benchmarks/cross_evaluation.py --root /tmp/cross --score-stored --games 128
    .venv/bin/python benchmarks/cross_evaluation.py --preset halfcheetah-sac --set distribution.mode=async \
        --env-steps 30000 --seeds 1 2 3 4 5 --trained-on envpool gymnasium --games 8 --root /tmp/crosshc

Each training run is the whole pipeline (Prefect flow, Dask LocalCluster, storage, MLflow) on the
preset's settings; only the seed, the budget, `env.backend`, the stores and what `--set` says change. The
run's delivered policy is then played greedily (its newest version: the run evaluates once, at its end),
`--games` whole games (one an env, seeded alike), on Gymnasium's Python path (what a run's evaluations
play) and on each C++ backend installed that has the task, under the evaluation's preprocessing (unclipped scores). The
baseline is the Gymnasium path's score of the same policy: a ratio near 1 says the backend is the task
Gymnasium's evaluation scores. Without sticky actions a greedy policy's game is set by its no-op start
(1-30), which each backend draws its own way: the means spread by the games drawn, hence many games.
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


def backends_with(preset) -> list[str]:
    """The backends installed here that have the preset's task (Gymnasium's always)."""
    from gymflow.envs.make import EnvSpecError
    from gymflow.tasks.cluster.jobs import BACKEND_TASKS

    preprocessing, having = preset.env.preprocessing().evaluation(), ["gymnasium"]
    for name, task_of in BACKEND_TASKS.items():
        try:
            task_of(preset.env.id, dict(preset.env.kwargs), preprocessing)
        except EnvSpecError:  # not installed, or without the task
            continue
        having.append(name)
    return sorted(having, key=BACKENDS.index)


def stored_runs(root: str) -> list[tuple[str, str, int, int]]:
    """(run id, the backend it trained on, its seed, its newest policy version) of each run under `root`."""
    from gymflow.presets.load import validate_preset_data
    from gymflow.tasks.storage.checkpoints import latest_policy_version
    from gymflow.tasks.storage.layout import RunLayout
    from gymflow.tasks.storage.objects import Storage, StorageLocation
    from gymflow.tasks.storage.records import read_stored_preset

    storage, runs = Storage(StorageLocation(root)), []
    for run_id in sorted(os.listdir(os.path.join(root, "runs"))):
        preset = validate_preset_data(read_stored_preset(storage, run_id))
        runs.append((run_id, preset.env.backend, preset.seed, latest_policy_version(storage, RunLayout(run_id))))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="breakout-ppo")
    parser.add_argument("--env-steps", type=int, default=150_000)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--trained-on", nargs="+", default=["ale", "gymnasium"], choices=BACKENDS)
    parser.add_argument("--games", type=int, default=64)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a preset field for the training runs (distribution.mode=async for EnvPool's MuJoCo)")
    parser.add_argument("--root", help="keep the runs' storage here (default: a temporary folder)")
    parser.add_argument("--score-stored", action="store_true",
                        help="train nothing: score the newest policy of every run stored under --root")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        root = args.root or os.path.join(folder, "data")
        if not args.score_stored:
            train(args, root, os.path.join(args.root or folder, "mlflow.db"))
        rows, scored_on, preset_name = [], [], args.preset  # (trained on, seed, version, {backend: its games' returns})
        for run_id, trained_on, seed, version in stored_runs(root):
            preset, policy = delivered_policy(root, run_id, version)
            scored_on, preset_name = backends_with(preset), preset.name
            scores = {backend: scores_on(backend, policy, preset, args.games, 10_000 + seed) for backend in scored_on}
            rows.append((trained_on, seed, version, scores))
            print(f"trained on {trained_on}, seed {seed}: v{version}, "
                  + ", ".join(f"{name} {_mean_and_interval(games)}" for name, games in scores.items()), flush=True)

    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"{preset_name}, greedy, {args.games} games a backend (mean return, 95% interval of the mean)")
    print(f"{'trained on':<11} {'seed':>4} {'version':>7} " + " ".join(f"{name:>16}" for name in scored_on))
    for trained_on, seed, version, scores in rows:
        print(f"{trained_on:<11} {seed:>4} {version:>7} "
              + " ".join(f"{_mean_and_interval(scores[name]):>16}" for name in scored_on))
    for other in scored_on[1:]:
        ratios = [statistics.mean(scores[other]) / statistics.mean(scores["gymnasium"])
                  for *_, scores in rows if statistics.mean(scores["gymnasium"]) > 0]
        print(f"{other} / gymnasium, median over runs: {np.median(ratios) if ratios else float('nan'):.2f}")


def _mean_and_interval(games: list[float]) -> str:
    """The games' mean return and the half-width of its 95% normal interval."""
    return f"{statistics.mean(games):.2f} ± {1.96 * statistics.stdev(games) / len(games) ** 0.5:.2f}"


def train(args: argparse.Namespace, root: str, mlflow_db: str) -> None:
    """One run of the preset a seed and training backend, stored under `root`."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "0")
    from gymflow.flows.improve import improve
    from gymflow.presets.load import parse_assignments

    for seed in args.seeds:
        for trained_on in args.trained_on:
            improve(args.preset, {**parse_assignments(args.set), "seed": seed, "schedule.total_env_steps": args.env_steps,
                                  "env.backend": trained_on, "schedule.evaluate_every_env_steps": args.env_steps,
                                  "storage.root": root, "tracking.tracking_uri": f"sqlite:///{mlflow_db}",
                                  "tracking.artifact_location": os.path.join(os.path.dirname(mlflow_db), "mlartifacts")})


if __name__ == "__main__":
    main()
