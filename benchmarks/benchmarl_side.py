"""BenchMARL's side of benchmarks/marl_vs_benchmarl.py: one BenchMARL run (MAPPO or IPPO) on MPE simple
spread, then its policy played greedily over seeded games; prints one JSON line.

Runs in BenchMARL's own environment (`.venv-benchmarl`, made by `marl_vs_benchmarl.py --setup`:
BenchMARL 1.5 reads MPE from PettingZoo 1.24, which gymflow's mpe2 replaced), never in gymflow's:

    .venv-benchmarl/bin/python benchmarks/benchmarl_side.py --algorithm mappo --seed 0 --frames 1000000
    .venv-benchmarl/bin/python benchmarks/benchmarl_side.py --play-scripted     # the env check: a scripted policy

BenchMARL's configurations are its own (`base_experiment.yaml`, `mappo.yaml` / `ippo.yaml`, the
`mlp` model for actor and critic), changed only where the task must match gymflow's: 25 steps a
game (its simple_spread.yaml says 100), discrete actions (`prefer_continuous_actions` false),
`max_n_frames` the budget; and where its own bookkeeping would cost the run time or need what is
not installed: no evaluation during training (the games below score it), no video, no wandb (csv).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import zlib

import numpy as np

GAMES_SEED = 123
TASK = {"task": "simple_spread_v3", "N": 3, "max_cycles": 25, "local_ratio": 0.5}
MOVES = {(1, 0): 2, (-1, 0): 1, (0, 1): 4, (0, -1): 3}  # MPE's discrete actions: +x, -x, +y, -y
ARRIVED = 0.05


def derive_seed(*parts: int | str) -> int:
    """gymflow's derive_seed (envs/seeding.py), so that game g here is game g there."""
    words = [zlib.crc32(part.encode()) if isinstance(part, str) else int(part) for part in parts]
    return int(np.random.SeedSequence(words).generate_state(1)[0])


def experiment(algorithm: str, seed: int, frames: int, folder: str):
    from benchmarl.algorithms import IppoConfig, MappoConfig
    from benchmarl.environments import PettingZooTask
    from benchmarl.experiment import Experiment, ExperimentConfig
    from benchmarl.models.mlp import MlpConfig

    config = ExperimentConfig.get_from_yaml()
    config.max_n_frames = frames
    config.prefer_continuous_actions = False  # the task's: discrete actions
    config.evaluation, config.render, config.loggers, config.create_json = False, False, ["csv"], False
    config.save_folder, config.checkpoint_at_end = folder, False
    task = PettingZooTask.SIMPLE_SPREAD.get_from_yaml()
    task.config.update({key: value for key, value in TASK.items() if key != "task"})
    algorithm_config = (MappoConfig if algorithm == "mappo" else IppoConfig).get_from_yaml()
    return Experiment(task=task, algorithm_config=algorithm_config, model_config=MlpConfig.get_from_yaml(),
                      critic_model_config=MlpConfig.get_from_yaml(), seed=seed, config=config)


def greedy_actions(policy, group: str, rows: np.ndarray) -> np.ndarray:
    import torch
    from tensordict import TensorDict
    from torchrl.envs.utils import ExplorationType, set_exploration_type

    data = TensorDict({group: TensorDict({"observation": torch.as_tensor(rows)}, batch_size=[len(rows)])},
                      batch_size=[])
    with torch.no_grad(), set_exploration_type(ExplorationType.DETERMINISTIC):
        return policy(data)[group, "action"].numpy()


def scripted_actions(rows: np.ndarray) -> np.ndarray:
    """Agent i walks to landmark i (benchmarks/spread_on_mappo_scale.py's Scripted)."""
    actions = np.zeros(len(rows), dtype=np.int64)
    for i, row in enumerate(rows):
        dx, dy = row[4 + 2 * i], row[5 + 2 * i]
        if max(abs(dx), abs(dy)) >= ARRIVED:
            actions[i] = MOVES[(int(np.sign(dx)), 0)] if abs(dx) >= abs(dy) else MOVES[(0, int(np.sign(dy)))]
    return actions


def play(act, games: int) -> list[float]:
    """Each game's mean agent return (PettingZoo's scale), games seeded as gymflow's evaluation's."""
    from pettingzoo.mpe import simple_spread_v3

    env = simple_spread_v3.parallel_env(N=3, max_cycles=25, local_ratio=0.5, continuous_actions=False)
    returns = []
    for game in range(games):
        observations, _ = env.reset(seed=derive_seed(GAMES_SEED, game))
        total = 0.0
        while env.agents:
            agents = list(env.agents)
            actions = act(np.stack([observations[agent] for agent in agents]).astype(np.float32))
            observations, rewards, _, _, _ = env.step({agent: int(actions[k]) for k, agent in enumerate(agents)})
            total += float(np.mean(list(rewards.values())))
        returns.append(total)
    env.close()
    return returns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", choices=["mappo", "ippo"], default="mappo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--frames", type=int, default=1_000_000, help="env steps (BenchMARL's frames)")
    parser.add_argument("--games", type=int, default=200)
    parser.add_argument("--play-scripted", action="store_true", help="only the scripted policy's games")
    args = parser.parse_args()
    if args.play_scripted:
        print(json.dumps({"scripted": play(scripted_actions, args.games)}))
        return
    with tempfile.TemporaryDirectory() as folder:
        run = experiment(args.algorithm, args.seed, args.frames, folder)
        started = time.perf_counter()
        run.run()
        seconds = time.perf_counter() - started
        group = next(iter(run.group_map))
        returns = play(lambda rows: greedy_actions(run.policy, group, rows), args.games)
    print(json.dumps({"algorithm": args.algorithm, "seed": args.seed, "frames": run.total_frames,
                      "train_seconds": seconds, "returns": returns}))


if __name__ == "__main__":
    main()
