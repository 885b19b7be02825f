"""Experience shards: one npz per (run, round, worker), loaded with allow_pickle=False.

A shard holds the rollout, the episodes that ended in it, and the env cursor the next round of
the same worker continues from. Stacked image observations are kept as their distinct frames,
compressed (agents/frames.py). The key is derived from (run, policy version, worker), so a
retried rollout overwrites its own shard and never adds a second one.

In single mode the rollout jobs run in the learner's process (`shards_kept_in_process`): a shard
is still written, and the learner takes the rollout it holds from memory instead of reading,
checking and decoding the bytes this process has just written.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np

from gymflow.agents.batches import Episodes, Rollout
from gymflow.agents.frames import FRAMES, frames_to_stacks, is_frame_stacks, stacks_to_frames
from gymflow.envs.vector import EnvCursor
from gymflow.tasks.storage.codec import decode_arrays, encode_arrays
from gymflow.tasks.storage.objects import Storage

_keeping: ContextVar[bool] = ContextVar("gymflow_shards_kept_in_process", default=False)
_KEPT: OrderedDict[tuple[str, str], Rollout] = OrderedDict()  # (shard url, sha256) -> the rollout stored there
_KEPT_MAX = 64  # rollouts held at most; a SYNC round's are taken by its learning step


@contextmanager
def shards_kept_in_process() -> Iterator[None]:
    """While inside, the rollouts of vector shards written here stay in this process's memory
    until `read_shard` takes them (frame shards are always read back: their stacks are rebuilt)."""
    token = _keeping.set(True)
    try:
        yield
    finally:
        _keeping.reset(token)


NO_POLICY = -1  # a shard's policy_version where heatup's uniform random policy acted
PRELUDE = ("prelude_episodes", "prelude_counts", "prelude_actions")  # an env cursor's optional arrays, in order


class ShardError(RuntimeError):
    """A shard that is missing or does not match the reference its writer returned."""


@dataclass(frozen=True)
class ShardRef:
    """What a rollout worker hands back: where its shard is and a summary of it."""

    key: str
    version: int | None  # policy version that acted; None for heatup's random policy
    worker: int
    env_steps: int
    episode_returns: tuple[float, ...]
    episode_lengths: tuple[int, ...]
    size: int
    sha256: str
    collect_seconds: float  # stepping envs and the policy, excluding storage
    collected_by: str  # host:pid of the process that collected it
    written_at: float = 0.0  # wall-clock (time.time()) when the shard was stored: its age is measured from here
    chunk: int | None = None  # async: its number in its worker's stream of chunks
    # what the collecting process's machine was doing, by MLflow's system-metric names (cluster/host_figures.py)
    host: tuple[tuple[str, float], ...] = ()
    # where the rollout's observations left the bounds their space declares (envs/steps.py), in words; None: they fit
    observations_outside: str | None = None


@dataclass(frozen=True)
class Collected:
    """What one rollout job collected, before it is stored."""

    rollout: Rollout
    episodes: Episodes
    cursor: EnvCursor  # where the envs stand afterwards: the next rollout of the worker continues here
    collect_seconds: float  # stepping envs and the policy, excluding storage


def write_shard(storage: Storage, key: str, version: int | None, worker: int, collected: Collected,
                chunk: int | None = None) -> ShardRef:
    rollout, episodes, cursor = collected.rollout, collected.episodes, collected.cursor
    arrays = {name: np.asarray(value) for name, value in rollout._asdict().items() if value is not None}
    arrays |= {
        "episode_returns": episodes.returns,
        "episode_lengths": episodes.lengths,
        "cursor_episode_index": cursor.episode_index,
        "cursor_action_counts": cursor.action_counts,
        "cursor_actions": cursor.actions,
        **({"cursor_memory": cursor.memory} if cursor.memory is not None else {}),
        **{f"cursor_{name}": getattr(cursor, name) for name in PRELUDE if getattr(cursor, name) is not None},
        "policy_version": np.int64(NO_POLICY if version is None else version),  # for exports: chunk keys lack it
    }
    pixels = is_frame_stacks(rollout.obs)
    if pixels:  # each frame once, and compressed: frames are mostly flat colour
        arrays |= stacks_to_frames(rollout)
    data = encode_arrays(arrays, compress=pixels)
    storage.write(key, data)
    sha256 = hashlib.sha256(data).hexdigest()
    if _keeping.get() and not pixels:
        _KEPT[(storage.url(key), sha256)] = rollout
        while len(_KEPT) > _KEPT_MAX:
            _KEPT.popitem(last=False)
    return ShardRef(
        key=key,
        version=version,
        worker=worker,
        env_steps=rollout.env_steps,
        episode_returns=tuple(float(x) for x in episodes.returns),
        episode_lengths=tuple(int(x) for x in episodes.lengths),
        size=len(data),
        sha256=sha256,
        collect_seconds=collected.collect_seconds,
        collected_by=f"{socket.gethostname()}:{os.getpid()}",
        written_at=time.time(),
        chunk=chunk,
    )


def read_shard(storage: Storage, ref: ShardRef) -> Rollout:
    """The rollout its writer reported in `ref`, checked against the reported size and sha256
    (or, written in this process moments ago, the rollout it holds: `shards_kept_in_process`)."""
    kept = _KEPT.pop((storage.url(ref.key), ref.sha256), None)
    return kept if kept is not None else _rollout(_read_verified(storage, ref))


def read_shard_at(storage: Storage, key: str) -> Rollout:
    """The rollout stored at `key`, for when no writer's report is at hand (rebuilding replay
    on resume)."""
    if not storage.exists(key):
        raise ShardError(f"shard {storage.url(key)} is missing")
    return _rollout(decode_arrays(storage.read(key)))


def _rollout(arrays: dict[str, np.ndarray]) -> Rollout:
    if FRAMES in arrays:
        arrays = frames_to_stacks(arrays)
    return Rollout(**{name: arrays[name] for name in Rollout._fields if name in arrays})  # memory: recurrent only


def read_cursor(storage: Storage, key: str) -> EnvCursor:
    if not storage.exists(key):
        raise ShardError(f"shard {storage.url(key)} is missing; cannot continue its envs")
    return _cursor(decode_arrays(storage.read(key)))


@dataclass(frozen=True)
class StoredShard:
    """A shard read whole: its rollout, the lengths of the episodes that ended in it (in the order
    of `rollout.done_index`), where its envs stood after it, and the policy version that acted
    (NO_POLICY for heatup's random policy; None where the shard predates recording it)."""

    key: str
    rollout: Rollout
    episode_lengths: np.ndarray
    cursor: EnvCursor
    policy_version: int | None


def read_stored_shard(storage: Storage, key: str) -> StoredShard:
    if not storage.exists(key):
        raise ShardError(f"shard {storage.url(key)} is missing")
    arrays = decode_arrays(storage.read(key))
    version = int(arrays["policy_version"]) if "policy_version" in arrays else None
    return StoredShard(key, _rollout(arrays), arrays["episode_lengths"], _cursor(arrays), version)


def _cursor(arrays: dict[str, np.ndarray]) -> EnvCursor:
    return EnvCursor(arrays["cursor_episode_index"], arrays["cursor_action_counts"], arrays["cursor_actions"],
                     arrays.get("cursor_memory"), *(arrays.get(f"cursor_{name}") for name in PRELUDE))


def _read_verified(storage: Storage, ref: ShardRef) -> dict[str, np.ndarray]:
    if not storage.exists(ref.key):
        raise ShardError(f"shard {storage.url(ref.key)} is missing")
    data = storage.read(ref.key)
    if len(data) != ref.size or hashlib.sha256(data).hexdigest() != ref.sha256:
        raise ShardError(f"shard {storage.url(ref.key)} does not match what its rollout wrote")
    return decode_arrays(data)
