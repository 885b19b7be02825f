"""A uniform replay memory: a numpy ring buffer of transitions."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Transitions(NamedTuple):
    obs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    next_obs: np.ndarray
    terminated: np.ndarray


class ReplayMemory:
    def __init__(self, capacity: int, obs_shape: tuple[int, ...], action_shape: tuple[int, ...], action_dtype):
        self.capacity = capacity
        self.arrays = {
            "obs": np.zeros((capacity, *obs_shape), np.float32),
            "actions": np.zeros((capacity, *action_shape), action_dtype),
            "rewards": np.zeros(capacity, np.float32),
            "next_obs": np.zeros((capacity, *obs_shape), np.float32),
            "terminated": np.zeros(capacity, bool),
        }
        self.size = 0
        self.cursor = 0  # where the next transition goes
        self.inserted = 0

    def __len__(self) -> int:
        return self.size

    def add(self, batch: Transitions) -> None:
        self.inserted += len(batch.rewards)
        if len(batch.rewards) > self.capacity:
            batch = Transitions(*(values[-self.capacity :] for values in batch))
        count = len(batch.rewards)
        index = (self.cursor + np.arange(count)) % self.capacity
        for name, values in batch._asdict().items():
            self.arrays[name][index] = values
        self.cursor = int((self.cursor + count) % self.capacity)
        self.size = min(self.size + count, self.capacity)

    def sample(self, batch_size: int, rng: np.random.Generator) -> Transitions:
        index = rng.integers(0, self.size, size=batch_size)
        return Transitions(**{name: values[index] for name, values in self.arrays.items()})

    def state_dict(self) -> dict[str, np.ndarray]:
        state = {name: values[: self.size] for name, values in self.arrays.items()}
        state["counters"] = np.array([self.size, self.cursor, self.inserted], dtype=np.int64)
        return state

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        self.size, self.cursor, self.inserted = (int(x) for x in state["counters"])
        for name in self.arrays:
            self.arrays[name][: self.size] = state[name]
