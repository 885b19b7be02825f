"""The learner's side of the improve loop: read exactly one round's shards, learn, commit.

The learner lives in the flow's process for the whole run; these functions give it data from
storage and put its state back into storage as committed checkpoint versions. `train_stretch`
is the Prefect task training runs in: a stretch of rounds (SYNC) or commits (ASYNC) of about
`TASK_SECONDS`, because a Prefect task run costs ~20 ms here (its engine in the flow's process,
its states and events in the API server, on the same two cores): one a round was a quarter of a
CartPole run's wall-clock (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from agents.core import Learner
from presets.errors import InvalidPreset
from presets.validate import Experiment
from tasks.checkpoints import (
    CheckpointRef,
    commit_checkpoint,
    encode_arrays,
    encode_state,
    encode_tensors,
)
from tasks.shards import ShardRef, read_shard
from tasks.storage import RunLayout, StorageLocation, open_storage


@dataclass(frozen=True)
class LearnResult:
    version: int  # the version this step committed
    metrics: dict[str, float]
    learn_seconds: float  # in the algorithm's update, excluding storage


def create_learner(experiment: Experiment, warm_start: dict[str, torch.Tensor] | None = None) -> Learner:
    """The run's learner, in this process, with the preset's number of torch threads, starting
    from `warm_start` policy weights when given."""
    config = experiment.preset
    torch.set_num_threads(config.distribution.learner_threads)
    learner = experiment.algorithm.learner(config.agent, experiment.observation_space, experiment.action_space, config.seed)
    if warm_start is not None:
        try:
            learner.load_policy_weights(warm_start)
        except RuntimeError as error:
            first_line = str(error).splitlines()[1].strip() if "\n" in str(error) else str(error)
            raise InvalidPreset("warm_start", f"the policy does not fit this preset's network: {first_line}") from None
    return learner


def save_checkpoint(
    location: StorageLocation,
    run_id: str,
    version: int,
    learner: Learner,
    counters: dict[str, Any],
    include_replay: bool,
) -> CheckpointRef:
    """Commit everything needed to act (policy.safetensors) and to resume (learner state,
    counters, and optionally the replay memory) as `version`."""
    learner_tensors, learner_tree = encode_state(learner.state_dict())
    blobs = {
        "policy.safetensors": encode_tensors(learner.policy_weights()),
        "learner.safetensors": learner_tensors,
        "learner.json": learner_tree,
        "counters.json": json.dumps(counters).encode(),
    }
    replay = getattr(learner, "replay", None)
    if include_replay and replay is not None:
        blobs["replay.npz"] = encode_arrays(replay.state_dict())
    return commit_checkpoint(open_storage(location), RunLayout(run_id), version, blobs)


TASK_SECONDS = 2.0  # the training one Prefect task run carries


@task(name="train", task_run_name="train-from-{label}", cache_policy=NO_CACHE)
def train_stretch(step: Callable[[], bool], label: str, seconds: float = TASK_SECONDS) -> int:
    """Training steps (a SYNC round, or an ASYNC commit period) one after another for about
    `seconds`, or until `step` answers that training is over. Returns how many ran."""
    started = time.perf_counter()
    steps = 0
    while True:
        steps += 1
        if step() or time.perf_counter() - started >= seconds:
            return steps


def learn(
    learner: Learner,
    location: StorageLocation,
    run_id: str,
    version: int,
    shards: Sequence[ShardRef],
    progress: float,
    counters: dict[str, Any],
    include_replay: bool = False,
) -> LearnResult:
    """Learn from the shards version `version` collected, then commit `version + 1`."""
    storage = open_storage(location)
    rollouts = [read_shard(storage, ref) for ref in shards]
    started = time.perf_counter()
    metrics = learner.learn(rollouts, progress)
    seconds = time.perf_counter() - started
    save_checkpoint(location, run_id, version + 1, learner, counters, include_replay)
    return LearnResult(version + 1, metrics, seconds)


@task(name="fill-replay", cache_policy=NO_CACHE)
def fill_replay(learner: Learner, location: StorageLocation, shards: Sequence[ShardRef]) -> int:
    """Insert heatup's shards into the replay memory; no learning. Returns the memory's size."""
    storage = open_storage(location)
    learner.remember([read_shard(storage, ref) for ref in shards])  # type: ignore[attr-defined]
    return len(learner.replay)  # type: ignore[attr-defined]
