"""A picture and a clock: the project's own small env with a Dict observation, so the Dict path
(flattening at the env's boundary, an encoder per part, the MLflow model taking the parts by
name) runs end to end in the tests and in the `picture-corridor-ppo` preset in seconds.
"""

from __future__ import annotations

from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class PictureCorridor(gym.Env):
    """A corridor whose goal lies at one end or the other (drawn at each reset), observed as a
    Gymnasium Dict: a small picture ("view", uint8 [5, length, 1], channels last: the walker's
    column white, the goal's grey) and the time gone ("clock", float32 [1]). Which way to walk is
    in the picture alone: a policy that does not read it wins half its episodes.

    Reward 1 at the goal (terminated), -0.01 a step otherwise; truncated after `max_steps`. With
    `continuous` the action is a Box [-1, 1]: a step right where it is above 0, else left."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"], "render_fps": 8}

    def __init__(self, length: int = 9, max_steps: int = 30, continuous: bool = False, render_mode: str | None = None):
        self.length, self.max_steps, self.render_mode = length, max_steps, render_mode
        self.observation_space = spaces.Dict({
            "view": spaces.Box(0, 255, shape=(5, length, 1), dtype=np.uint8),
            "clock": spaces.Box(0.0, 1.0, shape=(1,), dtype=np.float32),
        })
        self.continuous = continuous
        self.action_space = spaces.Box(-1.0, 1.0, (1,), np.float32) if continuous else spaces.Discrete(2)
        self._position, self._goal, self._steps = 0, 0, 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._goal = int(self.np_random.integers(0, 2)) * (self.length - 1)
        self._position, self._steps = self.length // 2, 0
        return self._observe(), {}

    def step(self, action):
        right = float(np.asarray(action).reshape(-1)[0]) > 0 if self.continuous else int(action) == 1
        self._position = int(np.clip(self._position + (1 if right else -1), 0, self.length - 1))
        self._steps += 1
        terminated = self._position == self._goal
        truncated = not terminated and self._steps >= self.max_steps
        return self._observe(), 1.0 if terminated else -0.01, terminated, truncated, {}

    def render(self) -> np.ndarray:
        return np.repeat(np.repeat(self._observe()["view"], 8, axis=0), 8, axis=1).repeat(3, axis=2)

    def _observe(self) -> dict[str, np.ndarray]:
        view = np.zeros((5, self.length, 1), dtype=np.uint8)
        view[:, self._goal] = 128
        view[:, self._position] = 255
        return {"view": view, "clock": np.array([self._steps / self.max_steps], np.float32)}
