"""The learner's side of the improve loop: it lives in the flow's process for the whole run;
these functions make it, give it experience from storage, and commit its versions back.

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
from typing import TYPE_CHECKING

from gymflow.agents.core import Learner, ReplayLearner
from gymflow.errors import UnusableWarmStart
from gymflow.presets.model import StorageConfig
from gymflow.presets.validate import Experiment, learner_device
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
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage
from gymflow.tasks.storage.retention import ShardFloor, delete_below
from gymflow.tasks.storage.shards import read_shard
from gymflow.tasks.training.collection import Experience
from gymflow.tasks.training.ledger import discard_segments_after
from gymflow.tasks.training.state import STATE_BLOB, LoopState

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Learned:
    metrics: dict[str, float]  # the learner's own, without namespace
    seconds: float  # in the algorithm's updates, excluding storage


def import_optimizer_machinery() -> None:
    """What torch imports at the first optimizer a process makes (`torch._dynamo`, ~1.5 s),
    imported now: the command line does it while its Prefect API starts."""
    import torch._dynamo  # noqa: F401


def create_learner(experiment: Experiment, warm_start: dict[str, torch.Tensor] | None = None) -> Learner:
    """The run's learner, in this process, with the preset's number of torch threads, starting
    from `warm_start` policy weights when given."""
    import torch  # here: the modules a flow imports stay free of torch

    config = experiment.preset
    torch.set_num_threads(config.distribution.learner_threads)
    learner = experiment.algorithm.learner(config.agent, experiment.observation_space, experiment.action_space,
                                           config.seed, learner_device(config))
    if warm_start is not None:
        if (misfit := warm_start_misfit(learner.policy_weights(), warm_start)) is not None:
            raise UnusableWarmStart("warm_start", f"the policy does not fit this preset's network: {misfit}")
        learner.load_policy_weights(warm_start)
    return learner


_STATISTICS = (".mean", ".var", ".count")  # an ObservationNormalizer's buffers, in a network's weights


def warm_start_misfit(expected: dict[str, torch.Tensor], given: dict[str, torch.Tensor]) -> str | None:
    """Why weights `given` cannot start a network whose own weights are `expected`: names or
    shapes that differ, said in the preset's terms where they can be; None if they fit."""
    missing, extra = [k for k in expected if k not in given], [k for k in given if k not in expected]
    if any(key.endswith(_STATISTICS) for key in missing + extra):
        return "agent.normalize_observations must be as it was in the run that trained the policy"
    if missing or extra:
        return f"it has no {missing[0]}" if missing else f"it has {extra[0]}, which this network has not"
    for key, tensor in expected.items():
        if tuple(given[key].shape) != tuple(tensor.shape):
            return f"{key} is {tuple(given[key].shape)}, this network's is {tuple(tensor.shape)} (agent.hidden_sizes?)"
    return None


def learn(learner: Learner, storage: Storage, experience: Experience, progress: float) -> Learned:
    """Learn from one collection step's shards (sha256 checked as they are read): a SYNC
    iteration through the learner's own `learn`; ASYNC shards inserted into replay, then the
    gradient steps the ratio allows. `progress` in [0, 1] drives the learner's schedules."""
    rollouts = [read_shard(storage, shard) for shard in experience.shards]
    started = time.perf_counter()
    if experience.train_steps is None:
        metrics = learner.learn(rollouts, progress)
    elif isinstance(learner, ReplayLearner):  # ASYNC: the ratio of samples to inserts chose the steps
        learner.insert(rollouts)
        metrics = learner.train(experience.train_steps, progress) if experience.train_steps else {}
    else:
        raise TypeError(f"{type(learner).__name__} keeps no replay memory")
    return Learned(metrics, time.perf_counter() - started)


@dataclass(frozen=True)
class Cadence:
    """When a committed version also gets a full checkpoint (storage.checkpoint_every_*)."""

    every_env_steps: int | None
    every_seconds: float | None

    def due(self, state: LoopState, last_env_steps: int, last_time: float) -> bool:
        if self.every_env_steps is None and self.every_seconds is None:
            return state.env_steps >= state.next_evaluation  # the version will be evaluated
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


class Checkpoints:
    """Publishes every committed version's policy and writes full checkpoints on the cadence,
    retiring what nothing can ask for any more; see the module's docstring. Close it at the end."""

    def __init__(self, storage: Storage, run_id: str, config: StorageConfig, policy_window: int):
        self.storage, self.layout, self.config = storage, RunLayout(run_id), config
        self.policy_window = policy_window  # versions behind the newest a rollout may still act with
        self.cadence = Cadence(config.checkpoint_every_env_steps, config.checkpoint_every_seconds)
        self.published = deque(versions_on(storage, self.layout.policies))  # a resumed run's, too
        self._last: tuple[int, float] | None = None  # env steps and time of the last checkpoint
        self._deleted_below: ShardFloor | None = None  # the floor the shards were last deleted below
        self.retirement = Retirement()

    def publish(self, learner: Learner, version: int, pinned: Collection[int] = ()) -> None:
        """Publish `version`'s policy; retire those older than the policy window, except the
        `pinned` ones (an evaluation is scoring them)."""
        publish_policy(self.storage, self.layout, version, {POLICY_BLOB: encode_tensors(learner.policy_weights())})
        if not self.published or self.published[-1] != version:
            self.published.append(version)
        for old in [v for v in self.published if v < version - self.policy_window and v not in pinned]:
            self.retirement.later(retire_version, self.storage, self.layout.policies, old)
            self.published.remove(old)

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
        self._retire_checkpoints({state.version, *keep})
        return ref

    def _retire_checkpoints(self, keep: set[int]) -> None:
        stored = committed_versions(self.storage, self.layout)
        kept = set(stored[-self.config.keep_checkpoints:]) | (keep & set(stored))
        for version in stored:
            if version not in kept:
                self.retirement.later(retire_version, self.storage, self.layout.checkpoint_shelf, version)
        if self.config.keep_shards == "all":
            return
        try:
            blob = read_checkpoint(self.storage, self.layout, min(kept), [SHARD_FLOOR])[SHARD_FLOOR]
        except CheckpointError:  # an unverifiable or older-format checkpoint: keep every shard it may need
            return
        floor = ShardFloor.from_json(blob)
        self.retirement.later(delete_below, self.storage, self.layout, floor, self._deleted_below)
        self._deleted_below = floor

    def close(self) -> None:
        """Wait for the deletions under way."""
        self.retirement.close()

