"""Where the learner's experience comes from: the one interface the improve loop collects
through, its SYNC implementation (the ASYNC one is tasks/training/stream.py), and an offline
run's, which collects nothing.

SYNC: round v collects with policy version v on every rollout worker (one shard each) and the
learner learns from exactly those shards; nothing runs between rounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from gymflow.logs import AnyLogger
from gymflow.tasks.cluster.hosts import Hosts
from gymflow.tasks.cluster.rounds import RoundPlan, collect_round
from gymflow.tasks.storage.layout import parse_shard_key
from gymflow.tasks.storage.retention import ShardFloor
from gymflow.tasks.storage.shards import ShardRef
from gymflow.tasks.training.state import LoopState

if TYPE_CHECKING:
    from gymflow.agents.batches import Rollout

Exploration = Callable[[int], float]  # env steps -> the exploration parameter rollouts act with


@dataclass(frozen=True)
class Experience:
    """What one collection step hands the learner."""

    shards: tuple[ShardRef, ...]  # to learn from, in this order
    state: LoopState  # the loop's state after collecting: env steps, env cursors, stream position
    landed: tuple[ShardRef, ...] = ()  # every shard that arrived, dropped ones included
    train_steps: int | None = None  # ASYNC: gradient steps the ratio allows; None: the learner's own iteration
    collect_seconds: float = 0.0  # collection on the critical path: the slowest rollout, or waiting for shards
    metrics: dict[str, float] = field(default_factory=dict)  # the collection's own, namespaced
    learn: bool = True  # False: a collect-only run's, stored and not learned from
    read_ahead: tuple[Rollout, ...] | None = None  # `shards` already read (ASYNC on-policy); None: read them


class Collection(Protocol):
    """The improve loop's source of experience: SYNC rounds or the ASYNC stream."""

    def collect(self, state: LoopState) -> Experience:
        """Experience for the learner's next step, from where `state` stands."""
        ...

    def drained(self) -> bool:
        """Nothing is in flight and nothing collected is left to learn from."""
        ...

    def finish(self, state: LoopState) -> LoopState:
        """Training is over: let what is in flight land (and account for it)."""
        ...

    def cancel(self) -> None:
        """The run failed: give up on what is in flight."""
        ...

    def checkpointed(self, state: LoopState) -> ShardFloor:
        """`state` is being checkpointed: record what its accounting needs, and return the
        oldest experience a resume from it reads."""
        ...


class SyncRounds:
    """Round v: every rollout worker collects with version v, and the learner gets all shards."""

    def __init__(self, hosts: Hosts, plan: RoundPlan, exploration: Exploration, logger: AnyLogger,
                 replay_window: int = 0):
        self.hosts, self.plan, self.exploration, self.logger = hosts, plan, exploration, logger
        self.replay_window = replay_window  # transitions of past rounds a resume reads back into replay
        self.learning = not plan.preset.collect_only  # a collect-only run's rounds go to storage alone

    def collect(self, state: LoopState) -> Experience:
        exploration = self.exploration(state.env_steps)
        specs = self.plan.rollouts(state.version, exploration, state.env_cursors)
        shards = tuple(collect_round(self.hosts, specs, self.logger))
        env_steps = state.env_steps + sum(shard.env_steps for shard in shards)
        after = replace(state, env_steps=env_steps, env_cursors=tuple(shard.key for shard in shards))
        seconds = [shard.collect_seconds for shard in shards]
        one_after_another = self.hosts.distinct_slots(len(shards)) == 1  # single mode: one process steps them all
        return Experience(shards, after, landed=shards,
                          collect_seconds=sum(seconds) if one_after_another else max(seconds),
                          metrics={"rollout/exploration": exploration} if exploration else {}, learn=self.learning)

    def drained(self) -> bool:
        return True  # a round is over when `collect` returns

    def finish(self, state: LoopState) -> LoopState:
        return state

    def cancel(self) -> None:
        pass

    def checkpointed(self, state: LoopState) -> ShardFloor:
        """Rounds are all the same size: a resume from `state` reads the last round (its envs
        continue from it: the env cursors', older than the version's round where a copied learner
        took a version of its own) and the rounds that cover the replay window, heatup's while
        the window reaches back to it (or while version 0 continues heatup's envs)."""
        per_round = self.plan.preset.env_steps_per_iteration
        rounds = max(math.ceil(self.replay_window / per_round), 1)
        heatup = state.version == 0 or state.version * per_round < self.replay_window
        cursor_rounds = [shard.round for key in state.env_cursors if key and (shard := parse_shard_key(key))
                         and shard.round is not None]
        return ShardFloor(self.plan.workers, heatup, round=min([max(state.version - rounds, 0), *cursor_rounds]))


class OfflineSteps:
    """An offline run's: nothing is collected; each step is `train_steps` gradient steps on the
    memory the dataset filled."""

    def __init__(self, workers: int, train_steps: int):
        self.workers, self.train_steps = workers, train_steps

    def collect(self, state: LoopState) -> Experience:
        return Experience((), state, train_steps=self.train_steps)

    def drained(self) -> bool:
        return True

    def finish(self, state: LoopState) -> LoopState:
        return state

    def cancel(self) -> None:
        pass

    def checkpointed(self, state: LoopState) -> ShardFloor:
        return ShardFloor(self.workers, heatup=False, round=state.version)  # no shard: a resume reads the dataset

