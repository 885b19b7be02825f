"""The learner's side of the improve loop: it lives in the flow's process for the whole run;
these functions make it (from scratch or from a warm start) and give it experience from storage.
Its versions are committed back by tasks/training/commits.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gymflow.agents.core import Learner, ReplayLearner
from gymflow.errors import UnusableWarmStart
from gymflow.imports import uncollected
from gymflow.presets.validate import Experiment, learner_device
from gymflow.tasks.storage.objects import Storage
from gymflow.tasks.storage.shards import read_shard
from gymflow.tasks.training.collection import Experience

if TYPE_CHECKING:
    import torch

    from gymflow.tasks.training.learner_ranks import LearnerRanks


@dataclass(frozen=True)
class Learned:
    metrics: dict[str, float]  # the learner's own, without namespace
    seconds: float  # in the algorithm's updates, excluding storage


def import_run_machinery() -> None:
    """What a run imports once it starts, imported now: the command line does it while its
    Prefect API starts, on the core the API's start leaves free. Torch with every algorithm's
    networks, and MLflow's tracking client with its SQL store (~1.5 s): a flow's modules import
    none of them. (Not `torch._dynamo`, ~1.5 s more: the learners' optimizers step without it.)
    No garbage collections meanwhile (gymflow/imports.py)."""
    with uncollected():
        import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
        import mlflow.tracking  # noqa: F401

        from gymflow.tasks.cluster.jobs import import_job_machinery

        import_job_machinery()


def create_learner(experiment: Experiment, warm_start: dict[str, torch.Tensor] | None = None) -> Learner:
    """The run's learner, in this process, with the preset's number of torch threads, starting
    from `warm_start` policy weights when given."""
    import torch  # here: the modules a flow imports stay free of torch

    config = experiment.preset
    torch.set_num_threads(config.distribution.learner_threads)
    learner = experiment.algorithm.learner(config.agent, experiment.observation_space, experiment.action_space,
                                           config.seed, learner_device(config, experiment.observation_space))
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


def learn(learner: Learner, storage: Storage, experience: Experience, progress: float,
          ranks: LearnerRanks | None = None) -> Learned:
    """Learn from one collection step's shards (sha256 checked as they are read): a SYNC
    iteration through the learner's own `learn`; ASYNC shards inserted into replay, then the
    gradient steps the ratio allows; offline, no shards and the step's gradient steps.
    `progress` in [0, 1] drives the learner's schedules; with `ranks` (distribution.learners > 1)
    every rank makes the same calls. A collect-only run's shards stay in storage."""
    if not experience.learn:
        return Learned({}, 0.0)
    if experience.read_ahead is not None:
        rollouts = list(experience.read_ahead)
    else:
        rollouts = [read_shard(storage, shard) for shard in experience.shards]
    started = time.perf_counter()
    if experience.train_steps is None and not rollouts:  # ASYNC on-policy: every landed shard was too old
        return Learned({}, 0.0)
    calls: Learner | LearnerRanks = learner if ranks is None else ranks
    if experience.train_steps is None:
        metrics = calls.learn(rollouts, progress, [shard.worker for shard in experience.shards])
    elif isinstance(learner, ReplayLearner):  # ASYNC: the ratio of samples to inserts chose the steps; offline
        calls.insert(rollouts)
        metrics = calls.train(experience.train_steps, progress) if experience.train_steps else {}
    else:
        raise TypeError(f"{type(learner).__name__} keeps no replay memory")
    return Learned(metrics, time.perf_counter() - started)
