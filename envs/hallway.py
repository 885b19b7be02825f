"""Hallway: a small env with options, for hierarchical levels (agents/levels.py).

`env.id: gymflow.envs.hallway:Hallway`. With `task: walk` it trains the lower level's skills (walk
left, walk right: an option drawn at each reset, shown in the observation; or, with `option`, one
skill alone, for a level choosing between separate policies); with `task: exit` it
is the task above them (a sparse reward at the hallway's exit, at one end or the other), for one
flat policy or for a level that chooses the walking option every few steps.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class Hallway(gym.Env):
    """`length` cells, starting in the middle; action 0 steps left, 1 right (the ends stop you).
    Each reset draws which end is the exit (from the seed), shown in the observation.

    - task `walk`: an option (0 walk left, 1 walk right) is drawn at each reset; +1 for a step
      its way, -1 for a step the other way, 0 against a wall (the exit does not matter);
      truncated after `max_steps`. With `option` given, every game walks that option and the
      observation shows none (a one-skill walker needs no telling; the exit task shows none
      either until a level chooses).
    - task `exit`: reaching an end ends the game: +1 at the exit, 0 at the other end; truncated
      after `max_steps`. A random walk from the middle rarely gets to either, and a policy that
      ignores where the exit is gets there half the time at best.

    Observes [position in 0..1, the option as a one-hot, 1 where the exit is the right end]; in
    `exit` the option is the one a level above last chose (`choose`), zeros before it has.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"], "render_fps": 12}
    options = 2
    CELL = 8

    def __init__(self, task: Literal["walk", "exit"] = "exit", length: int = 61, max_steps: int = 100,
                 render_mode: str | None = None, option: int | None = None):
        if task not in ("walk", "exit"):
            raise TypeError(f"task must be 'walk' or 'exit', not {task!r}")
        if option is not None and (task != "walk" or option not in range(self.options)):
            raise TypeError(f"option is the walk task's fixed option, 0 or 1; not {option!r} on task {task!r}")
        self.task, self.length, self.max_steps, self.render_mode = task, length, max_steps, render_mode
        self.fixed_option = option
        self.observation_space = spaces.Box(0.0, 1.0, shape=(2 + self.options,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self._position, self._steps, self._option, self._exit = length // 2, 0, None, length - 1

    def choose(self, option: int) -> np.ndarray:
        """The option a level above wants walked; the observation that shows it."""
        self._option = int(option)
        return self._observe()

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._position, self._steps = self.length // 2, 0
        self._exit = (self.length - 1) * int(self.np_random.integers(0, 2))
        self._option = int(self.np_random.integers(0, self.options)) if self.task == "walk" else None
        if self.fixed_option is not None:
            self._option = self.fixed_option
        return self._observe(), {}

    def step(self, action):
        before = self._position
        self._position = int(np.clip(self._position + (1 if int(action) == 1 else -1), 0, self.length - 1))
        self._steps += 1
        if self.task == "walk":
            moved = self._position - before
            reward, terminated = float(moved if self._option == 1 else -moved), False
        else:
            terminated = self._position in (0, self.length - 1)
            reward = 1.0 if self._position == self._exit else 0.0
        truncated = not terminated and self._steps >= self.max_steps
        return self._observe(), reward, terminated, truncated, {}

    def render(self) -> np.ndarray:
        """The hallway as a row of cells: the walker white, the exit green."""
        cells = np.full((self.length, 3), 64, dtype=np.uint8)
        cells[self._exit] = (0, 160, 0)
        cells[self._position] = 255
        return np.repeat(np.repeat(cells[None], self.CELL * 2, axis=0), self.CELL, axis=1)

    def _observe(self) -> np.ndarray:
        observation = np.zeros(2 + self.options, dtype=np.float32)
        observation[0] = self._position / (self.length - 1)
        if self._option is not None and self.fixed_option is None:
            observation[1 + self._option] = 1.0
        observation[-1] = float(self._exit > 0)
        return observation
