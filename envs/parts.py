"""Dict observations (a Gymnasium `Dict` of Box parts: a camera image and joint angles at once)
as one flat float32 vector at the env's boundary. The vector env, rollouts, shards, replay
memories, datasets and evaluations see a 1-D Box; that Box (`PartsBox`) carries each part's place
in the vector, from which a network reads every part back with an encoder of its own (the CNN for
an image part, the vector entries as an MLP's input) and the MLflow model takes the parts by name.
Images travel as float32 here: four times their uint8 bytes."""

from __future__ import annotations

from typing import NamedTuple

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class Part(NamedTuple):
    """One part of a Dict observation and where it lies in the flat vector."""

    key: str
    shape: tuple[int, ...]  # as the env gives it
    image: bool  # uint8 [height, width], [channels, height, width] or [height, width, channels]: a CNN reads it
    start: int
    stop: int

    @property
    def channels_last(self) -> bool:
        return self.image and _channels_last(self.shape)

    @property
    def frames_shape(self) -> tuple[int, int, int]:
        """An image part's shape as the CNN reads it: [channels, height, width]."""
        return _frames_shape(self.shape)


def _channels_last(shape: tuple[int, ...]) -> bool:
    return len(shape) == 3 and shape[2] <= 4 < shape[0]


def _frames_shape(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """An image's [height, width], [channels, height, width] or [height, width, channels] as
    [channels, height, width]."""
    if len(shape) == 2:
        return (1, *shape)
    return (shape[2], shape[0], shape[1]) if _channels_last(shape) else shape


class PartsBox(spaces.Box):
    """The flat float32 Box a Dict observation becomes; `parts` in the Dict's (sorted) key order."""

    def __init__(self, low: np.ndarray, high: np.ndarray, parts: tuple[Part, ...]):
        super().__init__(low, high, dtype=np.float32)
        self.parts = parts


def observation_parts(space: spaces.Space) -> tuple[Part, ...]:
    """A flattened Dict observation's parts; () for any other observation."""
    return getattr(space, "parts", ())


def image_parts(space: spaces.Space) -> tuple[Part, ...]:
    return tuple(part for part in observation_parts(space) if part.image)


class FlatParts(gym.ObservationWrapper):
    """A Dict of Box parts observed as one flat float32 vector, its parts in key order (each part
    checked first: `part_problem`)."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        space = env.observation_space
        parts, lows, highs, start = [], [], [], 0
        for key in sorted(space.spaces):
            part = space.spaces[key]
            size = int(np.prod(part.shape))
            parts.append(Part(key, tuple(part.shape), _is_image_part(part), start, start + size))
            lows.append(np.asarray(part.low, np.float32).ravel())
            highs.append(np.asarray(part.high, np.float32).ravel())
            start += size
        self.parts = tuple(parts)
        self.observation_space = PartsBox(np.concatenate(lows), np.concatenate(highs), self.parts)

    def observation(self, observation: dict) -> np.ndarray:  # every env step: no batch, no checks
        return np.concatenate([np.asarray(observation[part.key], np.float32).ravel() for part in self.parts])


def flatten_parts(parts: tuple[Part, ...], batch: dict) -> np.ndarray:
    """A batch of Dict observations, {key: [N, *shape]}, as [N, flat size] float32."""
    missing = sorted({part.key for part in parts} - set(batch))
    if missing:
        raise ValueError(f"the observation lacks its parts {missing}; it has {sorted(batch)}")
    arrays = [np.asarray(batch[part.key], np.float32).reshape(-1, part.stop - part.start) for part in parts]
    return np.concatenate(arrays, axis=1)


def _is_image_part(part: spaces.Box) -> bool:
    return part.dtype == np.uint8 and len(part.shape) in (2, 3)


def part_problem(key: str, part: spaces.Space) -> str | None:
    """Why a Dict's part cannot be read (None: it can)."""
    if not isinstance(part, spaces.Box):
        return f"its Dict observation's part {key!r} is {part}; allowed: Box parts (vectors, or uint8 images)"
    if _is_image_part(part) and min(_frames_shape(tuple(part.shape))[1:]) < 5:
        return f"its Dict observation's image part {key!r} is {part.shape}; allowed: images of at least 5 x 5 pixels"
    if not _is_image_part(part) and not np.issubdtype(part.dtype, np.number):
        return f"its Dict observation's part {key!r} has dtype {part.dtype}; allowed: numbers"
    return None
