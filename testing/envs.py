"""Small, fast, deterministic environments for tests and smoke runs.

Use them as `env.id: gymflow.testing.envs:Corridor` in a preset.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from gymflow.envs.picture_corridor import PictureCorridor


class Corridor(gym.Env):
    """Walk right along a corridor to its end. Action 0 steps left, 1 steps right.

    Reward 1 at the end (terminated), -0.01 a step otherwise; truncated after `max_steps`.
    The start cell is drawn from the env's seeded RNG, so episodes differ but replay exactly.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"], "render_fps": 8}
    CELL = 16  # pixels a cell is wide and high when rendered

    def __init__(self, length: int = 8, max_steps: int = 50, render_mode: str | None = None):
        self.length = length
        self.max_steps = max_steps
        self.render_mode = render_mode
        self.observation_space = spaces.Box(0.0, 1.0, shape=(2,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self._position = 0
        self._steps = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._position = int(self.np_random.integers(0, self.length // 2))
        self._steps = 0
        return self._observe(), {}

    def step(self, action):
        self._position += 1 if int(action) == 1 else -1
        self._position = max(self._position, 0)
        self._steps += 1
        terminated = self._position >= self.length - 1
        truncated = not terminated and self._steps >= self.max_steps
        reward = 1.0 if terminated else -0.01
        return self._observe(), reward, terminated, truncated, {}

    def render(self) -> np.ndarray:
        """The corridor as one row of grey cells, the walker's cell white and the goal green."""
        cells = np.full((self.length, 3), 64, dtype=np.uint8)
        cells[-1] = (0, 160, 0)
        cells[min(self._position, self.length - 1)] = 255
        return np.repeat(np.repeat(cells[None], self.CELL, axis=0), self.CELL, axis=1)

    def _observe(self) -> np.ndarray:
        return np.array([self._position / (self.length - 1), self._steps / self.max_steps], np.float32)


class PartsCorridor(Corridor):
    """The corridor observed as a Dict of vector parts alone: where it stands, and the clock."""

    def __init__(self, length: int = 8, max_steps: int = 50, render_mode: str | None = None):
        super().__init__(length, max_steps, render_mode)
        self.observation_space = spaces.Dict({"position": spaces.Box(0.0, 1.0, (1,), np.float32),
                                              "clock": spaces.Box(0.0, 1.0, (1,), np.float32)})

    def _observe(self) -> dict[str, np.ndarray]:
        position, clock = super()._observe()
        return {"position": np.array([position], np.float32), "clock": np.array([clock], np.float32)}


class ContinuousCorridor(Corridor):
    """The corridor with a Box action: move by the action's value, clipped to [-1, 1]."""

    def __init__(self, length: int = 8, max_steps: int = 50, render_mode: str | None = None):
        super().__init__(length, max_steps, render_mode)
        self.action_space = spaces.Box(-1.0, 1.0, shape=(1,), dtype=np.float32)

    def step(self, action):
        return super().step(1 if float(np.asarray(action).reshape(-1)[0]) > 0 else 0)


class TwoWayCorridor(PictureCorridor):
    """PictureCorridor's task with a Box action and a vector for its observation: where the walker
    is, which end the goal is at (0 left, 1 right) and the time gone, so a policy that does not
    read the goal's side wins half its episodes."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(self, length: int = 9, max_steps: int = 30):
        super().__init__(length, max_steps, continuous=True)
        self.observation_space = spaces.Box(0.0, 1.0, shape=(3,), dtype=np.float32)

    def _observe(self) -> np.ndarray:
        return np.array([self._position / (self.length - 1), float(self._goal > 0), self._steps / self.max_steps],
                        np.float32)


class Fading(gym.Env):
    """One-step episodes that pay less the more episodes the process has begun (1 / episodes): each
    of a run's evaluations scores below the one before, whatever the policy learnt, as a collapsing
    policy's do. For tests of which version a run delivers."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}
    _episodes_in_process = 0

    def __init__(self):
        self.observation_space = spaces.Box(0.0, 1.0, shape=(1,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        Fading._episodes_in_process += 1
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), 1.0 / Fading._episodes_in_process, True, False, {}


class Offers(gym.Env):
    """A contextual bandit, as production sees one: a customer (four numbers drawn from the env's seeded
    RNG), two offers; offer 1 pays 1 when the customer's first two numbers sum above 0, offer 0 pays 1
    otherwise. One decision an episode. For tests of learning from logged decisions."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(self, steps_file: str | None = None):
        self.observation_space = spaces.Box(-5.0, 5.0, shape=(4,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self._customer = np.zeros(4, np.float32)
        self.steps_file = steps_file  # where each step is counted (a byte appended), across processes

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._customer = np.clip(self.np_random.normal(size=4), -5, 5).astype(np.float32)
        return self._customer.copy(), {}

    def step(self, action):
        if self.steps_file:
            with open(self.steps_file, "ab") as counted:
                counted.write(b".")
        return self._customer.copy(), float(int(action) == self.best_offer(self._customer)), True, False, {}

    @staticmethod
    def best_offer(customer: np.ndarray) -> int:
        return int(customer[0] + customer[1] > 0)


class Tripwire(Corridor):
    """The corridor, with one fault armed for fault-tolerance drills: on the `at_step`-th step
    taken in a Dask worker process, SIGKILL that process (`fault="kill"`) or hang it
    (`fault="hang"`). It fires once per `once_file`: the file is created as it fires, and a
    retried rollout finds it and runs clean. Its dynamics are the corridor's, so a drill and a
    clean run of the same preset and seed must end with the same weights.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}  # a film's steps would count towards the fault
    _steps_in_process = 0

    def __init__(self, at_step: int, once_file: str, fault: str = "kill", length: int = 8, max_steps: int = 50):
        super().__init__(length, max_steps)
        if fault not in ("kill", "hang"):
            raise ValueError("fault must be 'kill' or 'hang'")
        self.at_step, self.once_file, self.fault = at_step, once_file, fault

    def step(self, action):
        Tripwire._steps_in_process += 1
        if Tripwire._steps_in_process == self.at_step and _in_dask_worker() and _first_to_fire(self.once_file):
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            while True:  # hang: never return, as a wedged simulator would
                time.sleep(1)
        return super().step(action)


def _in_dask_worker() -> bool:
    try:
        from distributed import get_worker

        get_worker()
        return True
    except ValueError:
        return False


def _first_to_fire(once_file: str) -> bool:
    try:
        with open(once_file, "x") as handle:
            handle.write(str(os.getpid()))
        return True
    except FileExistsError:
        return False
