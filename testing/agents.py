"""A small, fast, deterministic PettingZoo parallel env for tests and smoke runs.

Use it as `env.id: "pettingzoo:gymflow.testing.agents:Exits"` in a preset.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from gymnasium import spaces
from pettingzoo import ParallelEnv


class Exits(ParallelEnv):
    """Walkers in corridors of their own, each walking right to its exit; a walker that reaches
    it is paid 1 and leaves the game (`agents` shrinks), every other step costs 0.01. A guide
    (group 'guide', 3 entries observed: it sees the mean walker position too) is paid what the
    walkers are paid, and stays until the game ends: when every walker has left, or at
    `max_steps` (truncated). Action 0 steps left, 1 right. Starts are drawn from the seed."""

    metadata: ClassVar[dict[str, Any]] = {"name": "exits_v0", "render_modes": ["rgb_array"], "render_fps": 8}
    CELL = 16

    def __init__(self, walkers: int = 2, length: int = 6, max_steps: int = 30, render_mode: str | None = None):
        self.walkers = [f"walker_{i}" for i in range(walkers)]
        self.possible_agents = [*self.walkers, "guide_0"]
        self.length, self.max_steps, self.render_mode = length, max_steps, render_mode
        self.agents: list[str] = []
        self._positions: dict[str, int] = {}
        self._steps = 0

    def observation_space(self, agent: str) -> spaces.Box:
        return spaces.Box(0.0, 1.0, shape=(3 if agent == "guide_0" else 2,), dtype=np.float32)

    def action_space(self, agent: str) -> spaces.Discrete:
        return spaces.Discrete(2)

    def reset(self, seed: int | None = None, options: dict | None = None):
        rng = np.random.default_rng(seed)
        self.agents = list(self.possible_agents)
        self._positions = {walker: int(rng.integers(0, self.length // 2)) for walker in self.walkers}
        self._steps = 0
        return {agent: self._observe(agent) for agent in self.agents}, {agent: {} for agent in self.agents}

    def step(self, actions: dict[str, Any]):
        self._steps += 1
        rewards = dict.fromkeys(self.agents, 0.0)
        arrived = []
        for walker in [agent for agent in self.agents if agent in self._positions]:
            step = 1 if int(actions[walker]) == 1 else -1
            self._positions[walker] = max(self._positions[walker] + step, 0)
            if self._positions[walker] >= self.length - 1:
                arrived.append(walker)
            rewards[walker] = 1.0 if walker in arrived else -0.01
        rewards["guide_0"] = float(np.mean([rewards[w] for w in rewards if w != "guide_0"]))
        walkers_left = len([a for a in self.agents if a in self._positions and a not in arrived])
        terminations = {agent: agent in arrived or (agent == "guide_0" and walkers_left == 0) for agent in self.agents}
        truncations = {agent: self._steps >= self.max_steps and not terminations[agent] for agent in self.agents}
        observations = {agent: self._observe(agent) for agent in self.agents}
        self.agents = [agent for agent in self.agents if not (terminations[agent] or truncations[agent])]
        for walker in arrived:
            del self._positions[walker]
        return observations, rewards, terminations, truncations, {agent: {} for agent in observations}

    def render(self) -> np.ndarray:
        """One row of cells per walker, the walker white, the exit green."""
        cells = np.full((len(self.walkers), self.length, 3), 64, dtype=np.uint8)
        cells[:, -1] = (0, 160, 0)
        for row, walker in enumerate(self.walkers):
            cells[row, min(self._positions.get(walker, self.length - 1), self.length - 1)] = 255
        return np.repeat(np.repeat(cells, self.CELL, axis=0), self.CELL, axis=1)

    def _observe(self, agent: str) -> np.ndarray:
        time = self._steps / self.max_steps
        if agent == "guide_0":
            mean = np.mean(list(self._positions.values())) if self._positions else self.length - 1
            return np.array([mean / (self.length - 1), time, len(self._positions) / len(self.walkers)], np.float32)
        return np.array([min(self._positions.get(agent, self.length - 1), self.length - 1) / (self.length - 1), time],
                        np.float32)
