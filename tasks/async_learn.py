"""ASYNC learning: insert shards as they land, train at a fixed ratio of samples to inserts,
commit a new policy version every `commit_every_train_steps` gradient steps.

The ratio works like Reverb's rate limiter. The learner trains while it owes samples
(samples_per_insert x inserted > sampled) and waits for shards when it does not; collection
pauses while the learner is more than one round of chunks behind. Shards collected by a policy
more than `max_policy_lag` versions behind the newest are dropped and counted.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agents.core import Learner
from tasks.learn import save_checkpoint
from tasks.shards import ShardRef, read_shard
from tasks.storage import StorageLocation, open_storage
from tasks.stream import Ledger, RolloutStream, admits


@dataclass
class AsyncTraining:
    """What the ASYNC learner carries from one commit to the next (it lives in the flow's process)."""

    learner: Learner
    stream: RolloutStream
    ledger: Ledger
    location: StorageLocation
    run_id: str
    samples_per_insert: float
    max_policy_lag: int
    commit_every: int
    total_env_steps: int
    exploration: Callable[[int], float]  # env steps -> the exploration parameter of new chunks
    include_replay: bool = False
    env_steps: int = 0  # collected so far, heatup and dropped shards included
    next_evaluation: int = 0  # env steps at which the next evaluation is due

    @property
    def owed_train_steps(self) -> int:
        owed = self.samples_per_insert * self.ledger.inserted_steps - self.ledger.sampled
        return max(math.floor(owed / self.learner.samples_per_train_step), 0)  # type: ignore[attr-defined]

    @property
    def collection_may_run(self) -> bool:
        """Under the budget, and the learner at most one round of chunks behind its ratio."""
        behind = self.samples_per_insert * self.ledger.inserted_steps - self.ledger.sampled
        allowance = self.samples_per_insert * self.stream.preset.steps_per_chunk * self.stream.workers
        return self.stream.submitted_steps < self.total_env_steps and behind <= allowance

    @property
    def exhausted(self) -> bool:
        """The budget is collected, every chunk has landed and the learner owes nothing."""
        return (self.stream.submitted_steps >= self.total_env_steps and not self.stream.in_flight
                and self.owed_train_steps == 0)

    def feed_workers(self) -> None:
        for worker in self.stream.idle_workers():
            if not self.collection_may_run:
                return
            self.stream.submit(worker, self.exploration(self.env_steps))


@dataclass
class AsyncLearnResult:
    version: int  # the version this step committed
    metrics: dict[str, float]
    landed: list[ShardRef] = field(default_factory=list)
    learn_seconds: float = 0.0  # in the algorithm's updates
    waiting_seconds: float = 0.0  # waiting for shards to land (the learner had nothing owed)


def learn_async(training: AsyncTraining, version: int) -> AsyncLearnResult:
    """Insert landed shards and train until `commit_every` gradient steps are done (or the
    budget is used up), then commit `version + 1`."""
    started = time.perf_counter()
    storage = open_storage(training.location)
    landed: list[ShardRef] = []
    lags: list[int] = []
    ages: list[float] = []
    learner_rows: list[tuple[int, dict[str, float]]] = []
    steps_done = learn_seconds = waiting_seconds = 0.0
    inserted_before, sampled_before = training.ledger.inserted_steps, training.ledger.sampled
    while steps_done < training.commit_every and not training.exhausted:
        training.feed_workers()
        waited = time.perf_counter()
        refs = training.stream.landed(wait_s=1.0 if training.owed_train_steps == 0 else 0.0)
        if training.owed_train_steps == 0:
            waiting_seconds += time.perf_counter() - waited
        for ref in refs:
            landed.append(ref)
            training.env_steps += ref.env_steps
            lag = version - ref.version
            training.ledger.lags[ref.key] = lag
            lags.append(lag)
            if admits(ref.version, version, training.max_policy_lag):
                ages.append(time.time() - ref.written_at)
                training.learner.remember([read_shard(storage, ref)])  # type: ignore[attr-defined]
                training.ledger.inserted.append(ref.key)
                training.ledger.inserted_steps += ref.env_steps
            else:
                training.ledger.dropped.append(ref.key)
        steps = min(training.owed_train_steps, int(training.commit_every - steps_done))
        if steps:
            trained = time.perf_counter()
            progress = min(training.env_steps / training.total_env_steps, 1.0)
            learner_rows.append((steps, training.learner.train(steps, progress)))  # type: ignore[attr-defined]
            learn_seconds += time.perf_counter() - trained
            training.ledger.sampled += steps * training.learner.samples_per_train_step  # type: ignore[attr-defined]
            steps_done += steps
    training.feed_workers()
    seconds = time.perf_counter() - started
    metrics = _learner_metrics(learner_rows) | {
        "async/policy_lag_mean": float(np.mean(lags)) if lags else float("nan"),
        "async/policy_lag_max": float(max(lags)) if lags else float("nan"),
        "async/shard_age_seconds": float(np.mean(ages)) if ages else float("nan"),
        "async/shards_inserted": float(len(training.ledger.inserted)),
        "async/shards_dropped": float(len(training.ledger.dropped)),
        "async/inserts_per_second": (training.ledger.inserted_steps - inserted_before) / seconds,
        "async/samples_per_second": (training.ledger.sampled - sampled_before) / seconds,
        "async/samples_per_insert": training.ledger.sampled / max(training.ledger.inserted_steps, 1),
        "async/workers_collecting": float(len(training.stream.in_flight)),
    }
    save_checkpoint(training.location, training.run_id, version + 1, training.learner,
                    position_of(training, version + 1), training.include_replay)
    return AsyncLearnResult(version + 1, {key: v for key, v in metrics.items() if not math.isnan(v)}, landed,
                            learn_seconds, waiting_seconds)


def position_of(training: AsyncTraining, version: int) -> dict[str, Any]:
    """The counters an ASYNC checkpoint stores: where to resume collection and what replay held."""
    return {
        "version": version,
        "env_steps": training.env_steps,
        "next_evaluation": training.next_evaluation,
        # a resumed run re-collects what was in flight: from the last landed chunk of each worker
        "resume_from": list(training.stream.resume_from),
        "next_chunk": [n - (1 if w in training.stream.in_flight else 0) for w, n in enumerate(training.stream.next_chunk)],
        "ledger": training.ledger.as_dict(),
    }


def _learner_metrics(rows: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Learner metrics of several train calls, weighted by their steps; counters from the last."""
    if not rows:
        return {}
    total = sum(steps for steps, _ in rows)
    last = rows[-1][1]
    merged = {f"train/{key}": sum(steps * row.get(key, 0.0) for steps, row in rows) / total for key in last}
    for key in ("replay_size", "train_steps"):
        if key in last:
            merged[f"train/{key}"] = last[key]
    return merged
