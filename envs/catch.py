"""Catch, in pixels: the project's own small image env, which a CNN learns in a minute or two
on a CPU, so the whole pixel path (frame stacks, CNN encoders, frame-once shards and replay)
runs end to end in the tests.

A ball falls from the top row of a `rows` x `columns` grid, one row a step, drifting one column
sideways a step (a random direction, kept until it bounces off a wall); a paddle on the bottom
row moves left, stays or moves right. When the ball reaches the bottom row the episode ends with
+1 if the paddle is under it, -1 if not. One frame shows where the ball is, not where it drifts:
the policy needs a stack of two. A random policy scores about -0.6, a perfect one +1.

Observations are one grey uint8 frame [rows * scale, columns * scale] (ball and paddle 255, the
rest 0); gymflow stacks frames (`env.frame_stack`) into [stack, height, width].
"""

from __future__ import annotations

from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class Catch(gym.Env):
    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"], "render_fps": 8}

    def __init__(self, rows: int = 10, columns: int = 5, scale: int = 2, render_mode: str | None = None):
        if rows < 3 or columns < 2 or scale < 1:
            raise ValueError(f"Catch needs rows >= 3, columns >= 2 and scale >= 1 (got {rows}, {columns}, {scale})")
        self.rows, self.columns, self.scale = rows, columns, scale
        self.render_mode = render_mode
        self.observation_space = spaces.Box(0, 255, shape=(rows * scale, columns * scale), dtype=np.uint8)
        self.action_space = spaces.Discrete(3)  # left, stay, right
        self._ball = (0, 0)
        self._drift = 1
        self._paddle = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._ball = (0, int(self.np_random.integers(0, self.columns)))
        self._drift = int(self.np_random.choice([-1, 1]))
        self._paddle = int(self.np_random.integers(0, self.columns))
        return self._frame(), {}

    def step(self, action):
        self._paddle = int(np.clip(self._paddle + int(action) - 1, 0, self.columns - 1))
        row, column = self._ball
        if not 0 <= column + self._drift < self.columns:
            self._drift = -self._drift
        self._ball = (row + 1, column + self._drift)
        terminated = self._ball[0] == self.rows - 1
        reward = (1.0 if self._ball[1] == self._paddle else -1.0) if terminated else 0.0
        return self._frame(), reward, terminated, False, {}

    def render(self) -> np.ndarray:
        """The grid in colour, 16 pixels a cell: a white ball, a green paddle."""
        cells = np.zeros((self.rows, self.columns, 3), dtype=np.uint8)
        cells[self.rows - 1, self._paddle] = (0, 200, 0)
        cells[self._ball] = 255
        return np.repeat(np.repeat(cells, 16, axis=0), 16, axis=1)

    def _frame(self) -> np.ndarray:
        cells = np.zeros((self.rows, self.columns), dtype=np.uint8)
        cells[self.rows - 1, self._paddle] = 255
        cells[self._ball] = 255
        return np.repeat(np.repeat(cells, self.scale, axis=0), self.scale, axis=1)
