"""Stacked image observations kept each frame once: in shards, and in the replay memory.

A rollout of frame stacks [T, N, k, height, width] holds every frame k times over (and the
final observation of an episode once more); at 84x84x4 a naive shard of 2,048 steps is 58 MB.
Here a shard keeps the distinct frames once, [F, height, width], and for every stack the k
indices of its frames. A stack that continues its env's previous one (its first k-1 frames are
that one's last k-1) adds one frame; a stack that starts an episode adds its distinct frames
(a reset stack repeats its first frame). Frames are reused only where they compare equal, so
the stacks rebuilt on reading are byte-identical to those written, whatever the env does.
A rollout's frames are found within that rollout alone, so how many it adds depends on nothing
else (a replay memory rebuilt from shards stands where the original stood).
"""

from __future__ import annotations

import numpy as np

from gymflow.agents.batches import Rollout

FRAMES = "frames"  # the array of distinct frames; its presence marks a shard stored this way
STACKED = ("obs", "done_obs", "last_obs")  # the rollout's arrays of stacks, stored as frame indices


def is_frame_stacks(obs: np.ndarray) -> bool:
    """Rollout observations [T, N, k, height, width] of uint8 frames."""
    return obs.ndim == 5 and obs.dtype == np.uint8


class _StackRelations:
    """For one env's stacks [T, k, height, width], compared all at once: whether stack t continues
    stack t-1 (its first k-1 frames are that one's last k-1), and whether its newest frame
    repeats that one's."""

    def __init__(self, stacks: np.ndarray) -> None:
        pixels = stacks.reshape(*stacks.shape[:2], -1)
        self.continues = np.zeros(len(stacks), dtype=bool)
        self.continues[1:] = (pixels[1:, :-1] == pixels[:-1, 1:]).all(axis=(1, 2))
        self.newest_repeats = np.zeros(len(stacks), dtype=bool)
        self.newest_repeats[1:] = (pixels[1:, -1] == pixels[:-1, -1]).all(axis=1)


class _FrameTable:
    def __init__(self) -> None:
        self.frames: list[np.ndarray] = []

    def add(self, frame: np.ndarray) -> int:
        self.frames.append(frame)
        return len(self.frames) - 1

    def index(self, stack: np.ndarray, previous: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray:
        """The frame indices of `stack`, adding the frames it does not share with the stack
        before it in its env (`previous`: that stack and its indices) or with itself."""
        if previous is not None and np.array_equal(stack[:-1], previous[0][1:]):
            newest = previous[1][-1] if np.array_equal(stack[-1], previous[0][-1]) else self.add(stack[-1])
            return np.append(previous[1][1:], newest)
        indices = np.empty(len(stack), dtype=np.int32)
        for k, frame in enumerate(stack):
            indices[k] = indices[k - 1] if k and np.array_equal(frame, stack[k - 1]) else self.add(frame)
        return indices

    def index_env(self, stacks: np.ndarray, final_stacks: dict[int, np.ndarray]) -> tuple[np.ndarray, dict]:
        """`index` for each of one env's stacks [T, k, ...] in turn (compared all at once), and
        for the final stack of each episode that ended at step t (`final_stacks`: t -> stack)
        right after stack t's: the indices of both."""
        relations = _StackRelations(stacks)
        indices = np.empty(stacks.shape[:2], dtype=np.int32)
        final_indices: dict[int, np.ndarray] = {}
        for t, stack in enumerate(stacks):
            if relations.continues[t]:
                indices[t, :-1] = indices[t - 1, 1:]
                indices[t, -1] = indices[t - 1, -1] if relations.newest_repeats[t] else self.add(stack[-1])
            else:
                indices[t] = self.index(stack, None)
            if t in final_stacks:
                final_indices[t] = self.index(final_stacks[t], (stack, indices[t]))
        return indices, final_indices


def stacks_to_frames(rollout: Rollout) -> dict[str, np.ndarray]:
    """The arrays stored in place of a rollout's stacks: `frames` and, for each of `STACKED`,
    its frame indices ([..., k] int32)."""
    obs, done_index, done_obs, last_obs = rollout.obs, rollout.done_index, rollout.done_obs, rollout.last_obs
    steps, envs, depth = obs.shape[:3]
    table = _FrameTable()
    obs_index = np.empty((steps, envs, depth), dtype=np.int32)
    done_obs_index = np.empty((len(done_index), depth), dtype=np.int32)
    last_obs_index = np.empty((envs, depth), dtype=np.int32)
    for n in range(envs):
        ended = {int(flat) // envs: row for row, flat in enumerate(done_index) if flat % envs == n}  # step -> row
        obs_index[:, n], final_indices = table.index_env(obs[:, n], {t: done_obs[row] for t, row in ended.items()})
        for t, row in ended.items():
            done_obs_index[row] = final_indices[t]
        last_obs_index[n] = table.index(last_obs[n], (obs[-1, n], obs_index[-1, n]) if steps else None)
    frames = np.stack(table.frames) if table.frames else np.zeros((0, *obs.shape[3:]), obs.dtype)
    return {FRAMES: frames, "obs": obs_index, "done_obs": done_obs_index, "last_obs": last_obs_index}


def frames_to_stacks(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The shard's arrays with each of `STACKED` rebuilt as stacks of frames."""
    frames = arrays[FRAMES]
    rebuilt = {name: value for name, value in arrays.items() if name != FRAMES}
    for name in STACKED:
        rebuilt[name] = frames[arrays[name]]
    return rebuilt
