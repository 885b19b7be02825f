"""Commits and retention, in one place: what a run writes for each version it commits, and one
retention policy for what it deletes once nothing can ask for it.

Every committed version publishes what a rollout worker needs to act (`policies/vN`, kept while
the lag bound or an evaluation may ask for it). A full checkpoint — what a resumed run needs: the
learner's state, the loop's state, the replay memory or where it stood — is written on the
preset's cadence and at the end; the newest `storage.keep_checkpoints` are kept, and the shards
no kept checkpoint needs are deleted (tasks/storage/retention.py). tasks/storage/checkpoints.py
makes each commit atomic and verifiable.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from gymflow.agents.core import Learner, ReplayLearner
from gymflow.presets.model import OpponentPool, StorageConfig
from gymflow.tasks.storage.checkpoints import (
    LEARNER_TENSORS,
    LEARNER_TREE,
    POLICY_BLOB,
    REPLAY_BLOB,
    REPLAY_POSITION,
    SHARD_FLOOR,
    CheckpointError,
    CheckpointRef,
    commit_checkpoint,
    committed_versions,
    publish_policy,
    read_checkpoint,
    retire_version,
    versions_on,
)
from gymflow.tasks.storage.codec import encode_arrays, encode_state, encode_tensors
from gymflow.tasks.storage.layout import RunLayout, pinned_version
from gymflow.tasks.storage.objects import Storage
from gymflow.tasks.storage.retention import ShardFloor, delete_below
from gymflow.tasks.training.ledger import discard_segments_after
from gymflow.tasks.training.state import STATE_BLOB, Budget, LoopState


@dataclass(frozen=True)
class InUse:
    """The versions a run may still read, which retention keeps: the one an evaluation is scoring,
    the newest one scored, the one the run will deliver because it reached the target, and the best
    scored so far (the run delivers the best evaluated version: its policy and checkpoint go with it)."""

    scoring: frozenset[int] = frozenset()
    latest: int | None = None
    delivering: int | None = None
    best: int | None = None

    @property
    def policies(self) -> set[int]:
        return set(self.scoring) | {v for v in (self.latest, self.best) if v is not None}

    @property
    def checkpoints(self) -> set[int]:
        return {v for v in (self.delivering, self.best) if v is not None}


@dataclass(frozen=True)
class Cadence:
    """When a committed version also gets a full checkpoint (storage.checkpoint_every_*)."""

    every_env_steps: int | None
    every_seconds: float | None
    budget: Budget | None = None  # the run's clock, which evaluations are due by (None: env steps)

    def due(self, state: LoopState, last_env_steps: int, last_time: float) -> bool:
        if self.every_env_steps is None and self.every_seconds is None:
            clock = self.budget.spent(state) if self.budget else state.env_steps
            return clock >= state.next_evaluation  # the version will be evaluated
        by_steps = self.every_env_steps is not None and state.env_steps - last_env_steps >= self.every_env_steps
        by_time = self.every_seconds is not None and time.monotonic() - last_time >= self.every_seconds
        return by_steps or by_time


class Retirement:
    """Deletes what nothing needs any more on a thread of its own, in the order asked: deleting
    files costs tens of milliseconds a checkpoint once a run is past its replay window, and the
    commit path should not pay it. A deletion that failed is raised at the next request."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="retirement")
        self._pending: list[Future[None]] = []

    def later(self, delete: Callable[..., None], *args: object) -> None:
        self._raise_failures()
        self._pending.append(self._thread.submit(delete, *args))

    def wait(self) -> None:
        """Wait for every deletion asked for so far."""
        for future in list(self._pending):
            future.exception()  # waits
        self._raise_failures()

    def close(self) -> None:
        self.wait()
        self._thread.shutdown()

    def _raise_failures(self) -> None:
        for future in [future for future in self._pending if future.done()]:
            self._pending.remove(future)
            future.result()


class Commits:
    """Publishes every committed version's policy and writes full checkpoints on the cadence,
    retiring what nothing can ask for any more; see the module's docstring. Close it at the end."""

    def __init__(self, storage: Storage, run_id: str, config: StorageConfig, policy_window: int,
                 budget: Budget | None = None, pool: OpponentPool | None = None):
        self.storage, self.layout, self.config = storage, RunLayout(run_id), config
        self.pinnable = False  # other runs may pin its checkpoints (population members): look before retiring
        self.policy_window = policy_window  # versions behind the newest a rollout may still act with
        self.pool = pool  # self-play's past versions: rounds act against them
        kept = committed_versions(storage, self.layout) if pool is not None else []  # a resumed run's, too
        self._oldest_checkpoint: int | None = kept[0] if kept else None  # the oldest a run could resume from
        self.cadence = Cadence(config.checkpoint_every_env_steps, config.checkpoint_every_seconds, budget)
        self.published = deque(versions_on(storage, self.layout.policies))  # a resumed run's, too
        self._last: tuple[int, float] | None = None  # env steps and time of the last checkpoint
        self._deleted_below: ShardFloor | None = None  # the floor the shards were last deleted below
        self.retirement = Retirement()

    def commit(self, learner: Learner, state: LoopState, in_use: InUse, final: bool,
               floor: Callable[[LoopState], ShardFloor], before_checkpoint: Callable[[], None] = lambda: None
               ) -> bool:
        """Commit `state.version`: publish its policy, and checkpoint it when the cadence says so
        and at the end (`final`), with the shard `floor` its resume reads, after `before_checkpoint`;
        then retire what is not `in_use`. Returns whether it was checkpointed."""
        self.publish(learner, state.version, pinned=in_use.policies)
        checkpointed = self.due(state) or final
        if checkpointed:
            before_checkpoint()
            self.checkpoint(learner, state, floor(state), keep=in_use.checkpoints)
        return checkpointed

    def publish(self, learner: Learner, version: int, pinned: Collection[int] = ()) -> None:
        """Publish `version`'s policy; retire those older than the policy window, except the
        `pinned` ones (an evaluation is scoring them)."""
        publish_policy(self.storage, self.layout, version, {POLICY_BLOB: encode_tensors(learner.policy_weights())})
        if not self.published or self.published[-1] != version:
            self.published.append(version)
        pinned = set(pinned) | self._pool_snapshots()
        for old in [v for v in self.published if v < version - self.policy_window and v not in pinned]:
            self.retirement.later(retire_version, self.storage, self.layout.policies, old)
            self.published.remove(old)

    def _pool_snapshots(self) -> set[int]:
        """The snapshots a round may still face, from any checkpoint a run could resume from on:
        every one from the oldest member of the oldest kept checkpoint's pool."""
        if self.pool is None:
            return set()
        resumable = self._oldest_checkpoint
        oldest = (self.pool.members(resumable) or [0])[0] if resumable is not None else 0
        return {v for v in self.published if v % self.pool.every == 0 and v >= oldest}

    def resumed(self, learner: Learner, state: LoopState) -> None:
        """A resumed run continues from checkpoint `state.version`: what the dead run wrote after
        it (policies, checkpoints that did not verify, ledger segments) is discarded, and its
        policy is published again for the rollouts that continue from it."""
        for version in [v for v in self.published if v > state.version]:
            retire_version(self.storage, self.layout.policies, version)
            self.published.remove(version)
        for version in committed_versions(self.storage, self.layout):
            if version > state.version:
                retire_version(self.storage, self.layout.checkpoint_shelf, version)
        discard_segments_after(self.storage, self.layout, state.version)
        self.publish(learner, state.version)
        self._last = (state.env_steps, time.monotonic())

    def due(self, state: LoopState) -> bool:
        if self._last is None:
            return True
        return self.cadence.due(state, *self._last)

    def checkpoint(self, learner: Learner, state: LoopState, floor: ShardFloor, keep: Collection[int] = ()
                   ) -> CheckpointRef:
        """Everything needed to resume from `state`, as checkpoint `state.version`; then retire
        all but the newest `keep_checkpoints` (and `keep`), and the shards none of them needs."""
        learner_tensors, learner_tree = encode_state(learner.state_dict())
        blobs = {
            POLICY_BLOB: encode_tensors(learner.policy_weights()),
            LEARNER_TENSORS: learner_tensors,
            LEARNER_TREE: learner_tree,
            STATE_BLOB: state.to_json(),
            SHARD_FLOOR: floor.to_json(),
        }
        if isinstance(learner, ReplayLearner) and self.config.checkpoint_replay:
            blobs[REPLAY_BLOB] = encode_arrays(learner.replay.state_dict())
        elif isinstance(learner, ReplayLearner):
            blobs[REPLAY_POSITION] = json.dumps(learner.replay.position()).encode()
        ref = commit_checkpoint(self.storage, self.layout, state.version, blobs)
        self._last = (state.env_steps, time.monotonic())
        self._retire_checkpoints(state.version, set(keep))
        return ref

    def _retire_checkpoints(self, newest: int, keep: set[int]) -> None:
        """Keep the newest `keep_checkpoints` (and those other runs copy), which a resume may read, and
        the delivery's `keep`; the shards below what the oldest of the resumable ones reads go (a kept
        delivery-only checkpoint holds its learner, not the experience to resume it)."""
        stored = committed_versions(self.storage, self.layout)
        resumable = set(stored[-self.config.keep_checkpoints:]) | {newest}
        resumable |= self._pinned() & set(stored) if self.pinnable else set()
        kept = resumable | (keep & set(stored))
        self._oldest_checkpoint = min(resumable)
        for version in stored:
            if version not in kept:
                self.retirement.later(retire_version, self.storage, self.layout.checkpoint_shelf, version)
        if self.config.keep_shards == "all":
            return
        try:
            blob = read_checkpoint(self.storage, self.layout, min(resumable), [SHARD_FLOOR])[SHARD_FLOOR]
        except CheckpointError:  # an unverifiable or older-format checkpoint: keep every shard it may need
            return
        floor = ShardFloor.from_json(blob)
        self.retirement.later(delete_below, self.storage, self.layout, floor, self._deleted_below)
        self._deleted_below = floor

    def _pinned(self) -> set[int]:
        """The versions another run still copies (`RunLayout.pin`)."""
        return {pinned_version(key) for key in self.storage.list(self.layout.pins)}

    def close(self) -> None:
        """Wait for the deletions under way."""
        self.retirement.close()

