"""The learner's side of the improve loop: it lives in the flow's process for the whole run;
these functions make it, give it experience from storage, and commit its versions back.

A committed version holds what a rollout worker needs to act (`policy.safetensors`) and what a
resumed run needs (the learner's state, the loop's state and, where the preset asks for it,
the replay memory); tasks/storage/checkpoints.py makes the commit atomic and verifiable.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from gymflow.agents.core import Learner, ReplayLearner, Rollout
from gymflow.errors import UnusableWarmStart
from gymflow.presets.validate import Experiment
from gymflow.tasks.storage.checkpoints import (
    LEARNER_TENSORS,
    LEARNER_TREE,
    POLICY_BLOB,
    REPLAY_BLOB,
    CheckpointRef,
    commit_checkpoint,
)
from gymflow.tasks.storage.codec import encode_arrays, encode_state, encode_tensors
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage
from gymflow.tasks.storage.shards import ShardRef, read_shard
from gymflow.tasks.training.collection import Experience
from gymflow.tasks.training.state import STATE_BLOB, LoopState


@dataclass(frozen=True)
class Learned:
    metrics: dict[str, float]  # the learner's own, without namespace
    seconds: float  # in the algorithm's updates, excluding storage


def create_learner(experiment: Experiment, warm_start: dict[str, torch.Tensor] | None = None) -> Learner:
    """The run's learner, in this process, with the preset's number of torch threads, starting
    from `warm_start` policy weights when given."""
    config = experiment.preset
    torch.set_num_threads(config.distribution.learner_threads)
    learner = experiment.algorithm.learner(config.agent, experiment.observation_space, experiment.action_space,
                                           config.seed)
    if warm_start is not None:
        try:
            learner.load_policy_weights(warm_start)
        except RuntimeError as error:
            first_line = str(error).splitlines()[1].strip() if "\n" in str(error) else str(error)
            raise UnusableWarmStart("warm_start", f"the policy does not fit this preset's network: {first_line}") \
                from None
    return learner


def learn(learner: Learner, storage: Storage, experience: Experience, progress: float) -> Learned:
    """Learn from one collection step's shards (sha256 checked as they are read): a SYNC
    iteration through the learner's own `learn`; ASYNC shards inserted into replay, then the
    gradient steps the ratio allows. `progress` in [0, 1] drives the learner's schedules."""
    rollouts = [read_shard(storage, shard) for shard in experience.shards]
    started = time.perf_counter()
    if experience.train_steps is None:
        metrics = learner.learn(rollouts, progress)
    else:
        metrics = _remember_and_train(replay_learner(learner), rollouts, experience.train_steps, progress)
    return Learned(metrics, time.perf_counter() - started)


def _remember_and_train(learner: ReplayLearner, rollouts: Sequence[Rollout], steps: int,
                        progress: float) -> dict[str, float]:
    learner.remember(rollouts)
    return learner.train(steps, progress) if steps else {}


def replay_learner(learner: Learner) -> ReplayLearner:
    if not isinstance(learner, ReplayLearner):
        raise TypeError(f"{type(learner).__name__} keeps no replay memory")
    return learner


@dataclass(frozen=True)
class Checkpoints:
    """Commits a run's versions."""

    storage: Storage
    run_id: str
    include_replay: bool  # storage.checkpoint_replay

    def commit(self, learner: Learner, state: LoopState) -> CheckpointRef:
        """Everything needed to act and to resume from `state`, as version `state.version`."""
        learner_tensors, learner_tree = encode_state(learner.state_dict())
        blobs = {
            POLICY_BLOB: encode_tensors(learner.policy_weights()),
            LEARNER_TENSORS: learner_tensors,
            LEARNER_TREE: learner_tree,
            STATE_BLOB: state.to_json(),
        }
        if self.include_replay and isinstance(learner, ReplayLearner):
            blobs[REPLAY_BLOB] = encode_arrays(learner.replay.state_dict())
        return commit_checkpoint(self.storage, RunLayout(self.run_id), state.version, blobs)


@task(name="fill-replay", cache_policy=NO_CACHE)
def fill_replay(learner: ReplayLearner, storage: Storage, shards: Sequence[ShardRef]) -> int:
    """Insert heatup's shards into the replay memory; no learning. Returns the memory's size."""
    learner.remember([read_shard(storage, shard) for shard in shards])
    return len(learner.replay)
