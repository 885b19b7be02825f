"""Race: a two-player zero-sum PettingZoo parallel env, small enough for tests and self-play demos.

Use it as `env.id: "pettingzoo:gymflow.envs.race"` (its `parallel_env`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from gymnasium import spaces
from pettingzoo import ParallelEnv


class Race(ParallelEnv):
    """Two runners, each in a lane of `length` cells, race to its end. Each step a runner rests
    (action 0), runs one cell (1), or sprints (2): two cells with the probability its footing
    says, else a fall one cell back. Footing is drawn afresh for each runner every step (from the
    seed), and observed: sprinting pays (3f - 1 cells expected against running's 1) where the
    footing f is above 2/3, so a runner that has learnt when to sprint beats one that always runs.
    The first to arrive wins (+1; the other -1); both at once, or neither within `max_steps`, is
    a draw (0). Each observes its own and its rival's progress, the time, and its footing."""

    metadata: ClassVar[dict[str, Any]] = {"name": "race_v0", "render_modes": ["rgb_array"], "render_fps": 6}
    CELL = 12

    def __init__(self, length: int = 10, max_steps: int = 20, render_mode: str | None = None):
        self.possible_agents = ["runner_0", "runner_1"]
        self.length, self.max_steps, self.render_mode = length, max_steps, render_mode
        self.agents: list[str] = []
        self._cells = {agent: 0 for agent in self.possible_agents}
        self._footing = {agent: 0.0 for agent in self.possible_agents}
        self._steps = 0
        self._rng = np.random.default_rng()

    def observation_space(self, agent: str) -> spaces.Box:
        return spaces.Box(0.0, 1.0, shape=(4,), dtype=np.float32)

    def action_space(self, agent: str) -> spaces.Discrete:
        return spaces.Discrete(3)

    def reset(self, seed: int | None = None, options: dict | None = None):
        self._rng = np.random.default_rng(seed)
        self.agents = list(self.possible_agents)
        self._cells = {agent: 0 for agent in self.possible_agents}
        self._steps = 0
        self._draw_footing()
        return {agent: self._observe(agent) for agent in self.agents}, {agent: {} for agent in self.agents}

    def step(self, actions: dict[str, Any]):
        self._steps += 1
        for agent in self.agents:
            action = int(actions[agent])
            stride = action if action < 2 else (2 if self._rng.random() < self._footing[agent] else -1)
            self._cells[agent] = int(np.clip(self._cells[agent] + stride, 0, self.length))
        self._draw_footing()
        arrived = [agent for agent in self.agents if self._cells[agent] >= self.length]
        over = bool(arrived) or self._steps >= self.max_steps
        won = arrived[0] if len(arrived) == 1 else None
        rewards = {agent: 0.0 if won is None else (1.0 if agent == won else -1.0) for agent in self.agents}
        terminations = dict.fromkeys(self.agents, bool(arrived))
        truncations = dict.fromkeys(self.agents, over and not arrived)
        observations = {agent: self._observe(agent) for agent in self.agents}
        infos = {agent: {} for agent in self.agents}
        if over:
            self.agents = []
        return observations, rewards, terminations, truncations, infos

    def render(self) -> np.ndarray:
        """Two lanes, each runner white, the finish green."""
        lanes = np.full((2, self.length + 1, 3), 64, dtype=np.uint8)
        lanes[:, -1] = (0, 160, 0)
        for lane, agent in enumerate(self.possible_agents):
            lanes[lane, self._cells[agent]] = 255
        return np.repeat(np.repeat(lanes, self.CELL, axis=0), self.CELL, axis=1)

    def _draw_footing(self) -> None:
        self._footing = {agent: float(self._rng.random()) for agent in self.possible_agents}

    def _observe(self, agent: str) -> np.ndarray:
        rival = self.possible_agents[1 - self.possible_agents.index(agent)]
        return np.array([self._cells[agent] / self.length, self._cells[rival] / self.length,
                         self._steps / self.max_steps, self._footing[agent]], dtype=np.float32)


def parallel_env(**kwargs: Any) -> Race:
    return Race(**kwargs)
