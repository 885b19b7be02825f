"""Self-play against a pool of past versions against self-play against the current policy alone,
on Race (envs/race.py), at the same budget: `race-ppo` as it ships (the current policy plays both
sides) and the same preset with a `schedule.opponent_pool` (the newest `--size` snapshots, one
every `--every` versions, faced by a `--share` of the rollout jobs), a run of each per seed.

    .venv/bin/python benchmarks/self_play_pool.py --seeds 0 1 2 3 4 --games 200 --share 0.5

Each final policy then plays matches (agents/match.py: seeded games, sides swapped, both greedy):
against a uniformly random runner, against a runner that always runs (beaten only by sprinting
where the footing is good), and the pool's policy against the current-only policy of the same
seed. Scores are wins plus half the draws per game, with Wilson 95% intervals; the summary is the
median over seeds. Each run is a gymflow run as a user makes it (`improve`, single mode).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from typing import NamedTuple

import numpy as np

RACE = "pettingzoo:gymflow.envs.race"


class AlwaysRun:
    """Race's plain strategy: run one cell every step."""

    def act(self, obs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        return np.ones(len(obs), dtype=np.int64), np.zeros(len(obs), dtype=np.float32)


class Scores(NamedTuple):
    against_random: float
    against_always_run: float


def train(seed: int, folder: str, pool: dict | None):
    from gymflow.flows.improve import improve

    overrides = {"seed": seed, "distribution.mode": "single", "tracking.video": "off",
                 "storage.root": os.path.join(folder, "data"), "tracking.tracking_uri": f"sqlite:///{folder}/mlflow.db",
                 "tracking.artifact_location": f"{folder}/mlartifacts"}
    if pool is not None:
        overrides["schedule.opponent_pool"] = pool
    return improve("race-ppo", overrides)


def final_policy(folder: str, summary):
    from gymflow.agents.ppo import PPOPolicy, make_network
    from gymflow.envs.make import env_spaces
    from gymflow.presets.load import load_preset
    from gymflow.tasks.storage.checkpoints import POLICY_BLOB, read_policy
    from gymflow.tasks.storage.codec import decode_tensors
    from gymflow.tasks.storage.layout import RunLayout
    from gymflow.tasks.storage.objects import Storage, StorageLocation

    observation_space, action_space = env_spaces(RACE, {})
    network = make_network(load_preset("race-ppo").agent, observation_space, action_space)
    blobs = read_policy(Storage(StorageLocation(os.path.join(folder, "data"))), RunLayout(summary.run_id),
                        summary.delivered_version, [POLICY_BLOB])
    network.load_state_dict(decode_tensors(blobs[POLICY_BLOB]))
    return PPOPolicy(network, 0)


def match(first, second, games: int, seed: int):
    from gymflow.agents.match import play_match
    from gymflow.envs.agents import SeededAgentVectorEnv

    return play_match(first, second, SeededAgentVectorEnv(RACE, {}, games, seed))


def scores(policy, games: int, seed: int) -> tuple[Scores, str]:
    from gymflow.agents.rollout import RandomPolicy
    from gymflow.envs.make import env_spaces

    action_space = env_spaces(RACE, {})[1]
    random_result = match(policy, RandomPolicy(action_space, seed + 100), games, seed + 7)
    run_result = match(policy, AlwaysRun(), games, seed + 7)
    described = f"random {_described(random_result)}, always-run {_described(run_result)}"
    return Scores(random_result.score, run_result.score), described


def _described(result) -> str:
    low, high = result.interval()
    return f"{result.score:.2f} [{low:.2f}, {high:.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--games", type=int, default=200, help="games in each match")
    parser.add_argument("--size", type=int, default=5, help="snapshots in the pool")
    parser.add_argument("--every", type=int, default=4, help="versions between snapshots")
    parser.add_argument("--share", type=float, default=0.5, help="the share of rollout jobs that face a snapshot")
    args = parser.parse_args()
    pool = {"size": args.size, "every": args.every, "share": args.share}
    pooled, alone, head_to_head = [], [], []
    with tempfile.TemporaryDirectory() as folder:
        for seed in args.seeds:
            with_pool = final_policy(folder, train(seed, folder, pool))
            current_only = final_policy(folder, train(seed, folder, None))
            (pool_scores, pool_text), (alone_scores, alone_text) = (scores(with_pool, args.games, seed),
                                                                    scores(current_only, args.games, seed))
            duel = match(with_pool, current_only, args.games, seed + 11)
            pooled.append(pool_scores)
            alone.append(alone_scores)
            head_to_head.append(duel.score)
            print(f"seed {seed}: pool {pool_text}; current only {alone_text}; pool vs current only "
                  f"{_described(duel)}", flush=True)
    print(f"\nmachine: {os.cpu_count()} cores; race-ppo, pool {pool}, {args.games} games a match, medians over "
          f"{len(args.seeds)} seeds")
    for name, rows in (("pool", pooled), ("current only", alone)):
        print(f"{name:>13}: against random {statistics.median(r.against_random for r in rows):.3f}, against "
              f"always-run {statistics.median(r.against_always_run for r in rows):.3f}")
    print(f"pool vs current only: {statistics.median(head_to_head):.3f} (per seed: "
          f"{', '.join(f'{s:.2f}' for s in head_to_head)})")


if __name__ == "__main__":
    main()
