"""MPE simple spread on two scales: PettingZoo's (mpe2 `simple_spread_v3`, what gymflow's results
report: each agent's return, half the team's distance term and half its own collisions, their mean
over agents) and the MAPPO paper's (the original MPE as marlbenchmark/on-policy runs it: every
agent's reward is the distance term minus its collisions, itself included, and the team's reward is
their sum, summed over the 25 steps of a game). Published MAPPO figures are on the second scale.

    .venv/bin/python benchmarks/spread_on_mappo_scale.py --games 200
    .venv/bin/python benchmarks/spread_on_mappo_scale.py --preset spread-mappo --policy SEED0/policy.safetensors ...

Plays greedy games of a random policy, a scripted one (agent i walks to landmark i, no collision
avoidance) and, with --policy, a trained gymflow policy; each game's two returns are read from the
same steps (the MAPPO scale from mpe2's world after each step).
"""

from __future__ import annotations

import argparse

import numpy as np

SPREAD = "pettingzoo:mpe2.simple_spread_v3"
ARRIVED = 0.05  # the scripted agent stops this near its landmark
MOVES = {(1, 0): 2, (-1, 0): 1, (0, 1): 4, (0, -1): 3}  # mpe2's discrete actions: +x, -x, +y, -y


def mappo_team_reward(world) -> float:
    """One step's team reward on the original MPE's scale: each agent's -sum over landmarks of the
    nearest agent's distance, -1 for each agent it touches (itself included), summed over agents."""
    agents, landmarks = world.agents, world.landmarks
    distance_term = -sum(min(np.linalg.norm(a.state.p_pos - lm.state.p_pos) for a in agents) for lm in landmarks)
    touching = sum(np.linalg.norm(a.state.p_pos - b.state.p_pos) < a.size + b.size
                   for a in agents for b in agents)  # ordered pairs, each agent with itself too
    return len(agents) * distance_term - float(touching)


class Scripted:
    """Agent i walks toward landmark i along its larger offset (observation entries 4 + 2i, 5 + 2i)."""

    def act(self, rows: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        actions = np.zeros(len(rows), dtype=np.int64)
        for i, row in enumerate(rows):
            dx, dy = row[4 + 2 * i], row[5 + 2 * i]
            if max(abs(dx), abs(dy)) < ARRIVED:
                continue  # 0: no move
            actions[i] = MOVES[(int(np.sign(dx)), 0)] if abs(dx) >= abs(dy) else MOVES[(0, int(np.sign(dy)))]
        return actions, np.zeros(len(rows), dtype=np.float32)


def play(policy, games: int, seed: int, global_state: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Each game's mean agent return (PettingZoo's scale) and team return (the MAPPO paper's);
    `global_state`: the rows carry the game's state (a MAPPO policy's, which only its critic reads)."""
    from gymflow.envs.agents import AgentTable, make_parallel_env
    from gymflow.envs.seeding import derive_seed

    env = make_parallel_env(SPREAD, {})
    table = AgentTable.of(env, SPREAD, global_state)
    ours, theirs = np.zeros(games), np.zeros(games)
    for game in range(games):
        observations, _ = env.reset(seed=derive_seed(seed, game))
        while env.agents:
            state = env.state() if global_state else None
            rows = np.stack([table.row(k, observations[agent], state) for k, agent in enumerate(table.agents)])
            actions = policy.act(rows.astype(np.float32), False)[0]
            observations, rewards, _, _, _ = env.step({a: int(actions[k]) for k, a in enumerate(table.agents)})
            ours[game] += float(np.mean(list(rewards.values())))
            theirs[game] += mappo_team_reward(env.unwrapped.world)
    env.close()
    return ours, theirs


def trained(policy_path: str, preset_name: str):
    from gymflow.agents.ppo import PPOPolicy, make_network
    from gymflow.envs.make import env_spaces
    from gymflow.presets.load import load_preset
    from gymflow.tasks.storage.codec import decode_tensors

    preset = load_preset(preset_name)
    observation_space, action_space = env_spaces(SPREAD, dict(preset.env.kwargs), preset.env.preprocessing())
    network = make_network(preset.agent, observation_space, action_space)
    with open(policy_path, "rb") as blob:
        network.load_state_dict(decode_tensors(blob.read()))
    return PPOPolicy(network, 0), preset.env.global_state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--games", type=int, default=200)
    parser.add_argument("--seed", type=int, default=123)
    parser.add_argument("--policy", nargs="+", default=[],
                        help="trained policies' policy.safetensors (one preset's seeds: their median is printed too)")
    parser.add_argument("--preset", default="spread-ippo", help="the preset that trained --policy")
    args = parser.parse_args()
    from gymflow.agents.rollout import RandomPolicy
    from gymflow.envs.make import env_spaces

    policies = {"random": (RandomPolicy(env_spaces(SPREAD, {})[1], args.seed), False), "scripted": (Scripted(), False)}
    for number, path in enumerate(args.policy, 1):
        policies[f"{args.preset} #{number}"] = trained(path, args.preset)
    print(f"{args.games} greedy games of simple_spread_v3 (3 agents, 25 steps), seed {args.seed}")
    trained_means = []
    for name, (policy, global_state) in policies.items():
        ours, theirs = play(policy, args.games, args.seed, global_state)
        print(f"{name:>28}: PettingZoo scale (mean agent return) {ours.mean():7.2f}; MAPPO paper's scale (team "
              f"return) {theirs.mean():8.2f}")
        trained_means.append((ours.mean(), theirs.mean()))
    if len(args.policy) > 1:
        ours, theirs = np.median(np.array(trained_means[2:]), axis=0)
        print(f"{args.preset + ' median':>28}: PettingZoo scale {ours:7.2f}; MAPPO paper's scale {theirs:8.2f}")

if __name__ == "__main__":
    main()
