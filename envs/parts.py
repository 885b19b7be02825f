"""Dict observations (a Gymnasium `Dict` of Box parts: a camera image and joint angles at once)
as one flat array at the env's boundary. The vector env, rollouts, shards, replay memories,
datasets and evaluations see a 1-D Box; that Box (`PartsBox`) carries each part's place in the
array, from which a network reads every part back with an encoder of its own (the CNN for an
image part, the vector entries as an MLP's input) and the MLflow model takes the parts by name.

With an image among the parts the array is packed bytes (uint8): each image part's pixels as they
are, each vector part's float32 entries as their four bytes, so images keep their uint8 size
everywhere they travel and are kept. Without one it is the parts' float32 entries."""

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
    start: int  # where it lies in the flat array: bytes where that is packed, else entries
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


def lay_out(parts: list[tuple[str, tuple[int, ...], bool]]) -> tuple[Part, ...]:
    """(key, shape, image?) in order -> the parts' places in the flat array: packed bytes where an
    image is among them (a vector entry four bytes), else entries."""
    packed = any(image for _, _, image in parts)
    placed, start = [], 0
    for key, shape, image in parts:
        size = int(np.prod(shape)) * (4 if packed and not image else 1)
        placed.append(Part(key, tuple(shape), image, start, start + size))
        start += size
    return tuple(placed)


def is_packed(parts: tuple[Part, ...]) -> bool:
    return any(part.image for part in parts)


class PartsBox(spaces.Box):
    """The flat Box a Dict observation becomes, `parts` in the Dict's (sorted) key order: uint8
    bytes where they are packed (bounds 0..255: the bytes', not the values'), else float32.
    `dict_space`: the Dict as its parts are kept (images uint8, vectors float32)."""

    def __init__(self, parts: tuple[Part, ...], dict_space: spaces.Dict):
        if is_packed(parts):
            super().__init__(0, 255, (parts[-1].stop,), dtype=np.uint8)
        else:
            low = np.concatenate([dict_space[part.key].low.ravel() for part in parts])
            high = np.concatenate([dict_space[part.key].high.ravel() for part in parts])
            super().__init__(low, high, dtype=np.float32)
        self.parts = parts
        self.dict_space = dict_space


def observation_parts(space: spaces.Space) -> tuple[Part, ...]:
    """A flattened Dict observation's parts; () for any other observation."""
    return getattr(space, "parts", ())


def image_parts(space: spaces.Space) -> tuple[Part, ...]:
    return tuple(part for part in observation_parts(space) if part.image)


class FlatParts(gym.ObservationWrapper):
    """A Dict of Box parts observed as one flat array, its parts in key order (each part checked
    first: `part_problem`)."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        space = env.observation_space
        keys = sorted(space.spaces)
        self.parts = lay_out([(key, tuple(space[key].shape), _is_image_part(space[key])) for key in keys])
        kept = spaces.Dict({key: space[key] if _is_image_part(space[key]) else _as_float32(space[key]) for key in keys})
        self.observation_space = PartsBox(self.parts, kept)
        self.packed = is_packed(self.parts)

    def observation(self, observation: dict) -> np.ndarray:  # every env step: no batch, no checks
        if not self.packed:
            return np.concatenate([np.asarray(observation[part.key], np.float32).ravel() for part in self.parts])
        return np.concatenate([_part_bytes(part, observation[part.key]).ravel() for part in self.parts])


def _part_bytes(part: Part, values: np.ndarray) -> np.ndarray:
    """A part's values as they lie in a packed array: an image's uint8, a vector's float32 bytes."""
    if part.image:
        return np.asarray(values, np.uint8)
    return np.ascontiguousarray(values, np.float32).view(np.uint8)


def flatten_parts(parts: tuple[Part, ...], batch: dict) -> np.ndarray:
    """A batch of Dict observations, {key: [N, *shape]}, as the flat arrays [N, size] the env
    gives (packed bytes, or float32)."""
    missing = sorted({part.key for part in parts} - set(batch))
    if missing:
        raise ValueError(f"the observation lacks its parts {missing}; it has {sorted(batch)}")
    if not is_packed(parts):
        return np.concatenate([np.asarray(batch[p.key], np.float32).reshape(-1, p.stop - p.start) for p in parts], 1)
    rows = len(np.asarray(batch[parts[0].key]))
    return np.concatenate([_part_bytes(p, batch[p.key]).reshape(rows, p.stop - p.start) for p in parts], axis=1)


def unflatten_parts(parts: tuple[Part, ...], flat: np.ndarray) -> dict[str, np.ndarray]:
    """Flat arrays [N, size] back into the Dict's parts, {key: [N, *shape]}: images as uint8,
    vectors as float32."""
    packed, rows = is_packed(parts), len(flat)
    out = {}
    for part in parts:
        values = flat[:, part.start : part.stop]
        if part.image:
            out[part.key] = np.asarray(values, np.uint8).reshape(rows, *part.shape)
        elif packed:
            out[part.key] = np.ascontiguousarray(values, np.uint8).view(np.float32).reshape(rows, *part.shape)
        else:
            out[part.key] = np.asarray(values, np.float32).reshape(rows, *part.shape)
    return out


def vector_bytes(parts: tuple[Part, ...]) -> np.ndarray:
    """The positions, in a packed array, of its vector parts' bytes, in order (four an entry)."""
    return np.concatenate([np.arange(p.start, p.stop) for p in parts if not p.image] or [np.zeros(0, np.int64)])


def vector_values(flat: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Packed arrays [..., size] -> their vector parts' float32 entries [M, entries] (`positions`:
    `vector_bytes`)."""
    return np.ascontiguousarray(flat.reshape(-1, flat.shape[-1])[:, positions], np.uint8).view(np.float32)


def _as_float32(part: spaces.Box) -> spaces.Box:
    return spaces.Box(np.asarray(part.low, np.float32), np.asarray(part.high, np.float32), part.shape, np.float32)


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
