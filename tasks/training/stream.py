"""ASYNC collection (off-policy agents): every rollout worker always has its next chunk on the way.

The flow's process keeps one chunk job in flight per rollout worker. A chunk acts with the
newest committed policy version when it starts, continues its worker's envs from the previous
chunk, and writes one shard tagged with the version it used. Chunks go to the workers' job hosts
(tasks/cluster/hosts.py): a chunk whose worker dies is sent again under the same key to a live
worker, a chunk running past its deadline has its worker restarted and is sent again.

The learner trains at a fixed ratio of samples to inserts, as a Reverb rate limiter would: it
owes `samples_per_insert` x inserted - sampled samples. `collect` hands it the shards that landed
once it owes a commit period's worth of gradient steps (or once nothing more can land), and
collection pauses while the learner is more than one round of chunks behind. A shard collected
by a policy more than `max_policy_lag` versions behind the learner's is dropped and counted.
Every chunk lands once, in the ledger (tasks/training/ledger.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from gymflow.logs import AnyLogger
from gymflow.tasks.cluster.hosts import ATTEMPTS, Call, Hosts, wait_first
from gymflow.tasks.cluster.jobs import run_rollout
from gymflow.tasks.cluster.rounds import RoundPlan
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import open_storage, storage_location
from gymflow.tasks.storage.retention import ShardFloor
from gymflow.tasks.storage.shards import ShardRef
from gymflow.tasks.training.collection import Experience, Exploration
from gymflow.tasks.training.ledger import Ledger, LedgerBook, replay_tail, write_final_ledger
from gymflow.tasks.training.state import LoopState, StreamPosition


class LagBound:
    """The lag bound both pacings keep: a shard is inserted or learned from only if its policy is
    at most `max_policy_lag` versions behind the learner's newest committed one."""

    max_policy_lag: int

    def admits(self, shard_version: int, learner_version: int) -> bool:
        return learner_version - shard_version <= self.max_policy_lag


@dataclass(frozen=True)
class Ratio(LagBound):
    """How fast the learner may train against what lands."""

    samples_per_insert: float
    samples_per_train_step: int  # the learner's batch size
    commit_every: int  # gradient steps between committed versions
    max_policy_lag: int


@dataclass(frozen=True)
class Batches(LagBound):
    """How the on-policy learner is fed: a batch of at least `batch_steps` landed env steps."""

    batch_steps: int
    max_policy_lag: int


class ChunkStream:
    """What both ASYNC streams share: one chunk in flight per rollout worker, each landing once in
    the run's ledger, sent again if its worker is lost or wedged; how fast to collect and what to
    hand the learner is each stream's own (`AsyncStream` against a `Ratio`, the batch stream
    (tasks/training/batch_stream.py) in `Batches`)."""

    def __init__(self, hosts: Hosts, plan: RoundPlan, exploration: Exploration, logger: AnyLogger,
                 replay_window: int):
        self.hosts, self.plan, self.exploration, self.logger = hosts, plan, exploration, logger
        self.storage, self.layout = open_storage(storage_location(plan.preset.storage)), RunLayout(plan.run_id)
        self.in_flight: dict[int, Call] = {}
        self.next_chunk: list[int] = []  # per worker: the next chunk number to submit
        self.cursors: list[str | None] = []  # per worker: the last landed shard, whose envs continue
        self.replay_window = replay_window  # transitions of inserted shards a resume reads back (0: none kept)
        self.book = LedgerBook(Ledger(), replay_window)
        self.submitted_steps = -1  # env steps of every chunk submitted, heatup's included; -1: not started

    def _start_from(self, state: LoopState) -> None:
        """Take up the stream where `state` left it (the first time the stream is asked)."""
        if self.submitted_steps >= 0:
            return
        stream = state.stream or StreamPosition.start(self.plan.workers)
        self.next_chunk, self.cursors = list(stream.next_chunk), list(state.env_cursors)
        recent = replay_tail(self.storage, self.layout, state.version, self.replay_window) if state.stream else []
        self.book, self.submitted_steps = LedgerBook(stream.ledger, self.replay_window, recent), state.env_steps

    @property
    def total_env_steps(self) -> int:
        return self.plan.preset.schedule.total_env_steps

    def _may_collect(self) -> bool:
        raise NotImplementedError

    def _state_after(self, state: LoopState, landed: list[ShardRef]) -> LoopState:
        raise NotImplementedError

    def finish(self, state: LoopState) -> LoopState:
        """Submit nothing more and wait for the chunks in flight: they are recorded as unused,
        never inserted. Afterwards no chunk of this run is queued or running anywhere, and the
        run's ledger is written."""
        self._start_from(state)
        late = self._stop_collecting()
        deadline = time.monotonic() + self.hosts.timeout_s * ATTEMPTS
        while self.in_flight:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.in_flight)} rollout chunks did not finish after the stop")
            late += self._landed(wait_s=1.0)
        self.book.add_unused(late)
        self.book.write_segment(self.storage, self.layout, state.version)  # what landed since the last checkpoint
        write_final_ledger(self.storage, self.plan.run_id, self.book.counts, late)
        return self._state_after(state, late)

    def _stop_collecting(self) -> list[ShardRef]:
        """Training is over: what landed and was never handed to the learner (none here: every
        `collect` takes all that landed)."""
        return []

    def cancel(self) -> None:
        """Give up on the chunks in flight; a chunk already running finishes on its worker, and
        its shard is never read."""
        self.in_flight.clear()

    def checkpointed(self, state: LoopState) -> ShardFloor:
        """`state` is being checkpointed: the shards that landed since the last checkpoint go to
        the ledger's segment `state.version`. Returns the oldest shards a resume from it reads:
        each worker's last landed chunk (its envs continue from it), the inserted chunks that
        cover the replay window, heatup's while the window reaches back to it."""
        self._start_from(state)
        self.book.write_segment(self.storage, self.layout, state.version)
        landed = state.stream.next_chunk if state.stream else (0,) * self.plan.workers
        chunks = [max(count - 1, 0) for count in landed]
        for entry in self.book.recent:
            chunks[entry.record.worker] = min(chunks[entry.record.worker], entry.record.chunk)
        heatup = not self.book.replay_covered or min(landed) == 0
        segments = [entry.segment for entry in self.book.recent if entry.segment is not None]
        return ShardFloor(self.plan.workers, heatup, chunks=tuple(chunks),
                          segment=min(segments, default=state.version + 1))

    def _feed(self, env_steps: int) -> None:
        """Send each idle worker its next chunk, while collection may run."""
        self.in_flight |= self._submitted(self._next_chunks(env_steps))

    def _next_chunks(self, env_steps: int) -> dict[int, Any]:
        """The next chunk of each idle worker, while collection may run, counted as submitted
        (the bookkeeping half of `_feed`, quick)."""
        chunks: dict[int, Any] = {}
        for worker in range(self.plan.workers):
            if worker in self.in_flight or worker in chunks:
                continue
            if not self._may_collect():
                break
            chunks[worker] = self.plan.chunk(worker, self.next_chunk[worker], self.exploration(env_steps),
                                             self.cursors[worker])
            self.next_chunk[worker] += 1
            self.submitted_steps += self.plan.preset.steps_per_chunk
        return chunks

    def _submitted(self, chunks: dict[int, Any]) -> dict[int, Call]:
        """Each chunk sent to its worker's host (the half of `_feed` that may wait: for a host to start)."""
        return {worker: self.hosts.call(run_rollout, spec, slot=worker) for worker, spec in chunks.items()}

    def _landed(self, wait_s: float) -> list[ShardRef]:
        """The chunks that finished, waiting up to `wait_s` for the first one. A failed chunk
        raises; a lost or wedged one is sent again."""
        if not any(call.done() for call in self.in_flight.values()):
            wait_first(self.in_flight.values(), wait_s)
        return self._take_landed(self._settled(dict(self.in_flight)))

    def _settled(self, calls: dict[int, Call]) -> dict[int, Call]:
        """Each call settled (the half of `_landed` that may wait: for a lost scheduler, for
        workers), the soonest due first."""
        return {worker: self.hosts.settle(call, self.logger)
                for worker, call in sorted(calls.items(), key=lambda item: item[1].deadline)}

    def _take_landed(self, settled: dict[int, Call]) -> list[ShardRef]:
        """The settled calls in place of their workers' (a resent one's new call); the finished
        ones' shards, their workers idle again (the bookkeeping half of `_landed`, quick)."""
        shards = []
        for worker, call in settled.items():
            if worker not in self.in_flight:  # given up meanwhile (a cancel)
                continue
            self.in_flight[worker] = call
            if call.finished:
                shard = call.future.result()  # a chunk that failed for good raises here
                del self.in_flight[worker]
                self.cursors[worker] = shard.key
                shards.append(shard)
        return shards


class AsyncStream(ChunkStream):
    """The off-policy stream: one chunk in flight per rollout worker, inserted into replay as it
    lands, the learner paced by its `Ratio`; see the module's docstring."""

    def __init__(self, hosts: Hosts, plan: RoundPlan, ratio: Ratio, exploration: Exploration, logger: AnyLogger,
                 replay_window: int):
        super().__init__(hosts, plan, exploration, logger, replay_window)
        self.ratio = ratio
        self._period = (0.0, 0, 0)  # when the last commit period began, with the ledger's counters then

    def _start_from(self, state: LoopState) -> None:
        if self.submitted_steps >= 0:
            return
        super()._start_from(state)
        self._period = (time.perf_counter(), self.book.counts.inserted_steps, self.book.counts.sampled)

    def collect(self, state: LoopState) -> Experience:
        """The shards that have landed, waiting for more until the learner owes a commit period
        of gradient steps or nothing more can land; each inserted or dropped by the lag bound
        against `state.version`. Workers whose chunk landed get their next one at once."""
        self._start_from(state)
        landed: list[ShardRef] = []
        waited = 0.0
        while True:
            self._feed(state.env_steps + sum(shard.env_steps for shard in landed))
            enough = self._owed_train_steps() >= self.ratio.commit_every or not self.in_flight
            started = time.perf_counter()
            arrived = self._landed(wait_s=0.0 if enough else 1.0)  # what has landed is always taken
            waited += 0.0 if enough else time.perf_counter() - started
            for shard in arrived:
                self.book.record(shard, state.version - shard.version, self.ratio.admits(shard.version, state.version))
            landed += arrived
            if enough:
                self._feed(state.env_steps + sum(shard.env_steps for shard in landed))  # the workers that landed
                break
        admitted = [shard for shard in landed if self.ratio.admits(shard.version, state.version)]
        ages = [time.time() - shard.written_at for shard in admitted]
        train_steps = min(self._owed_train_steps(), self.ratio.commit_every)
        self.book.add_sampled(train_steps * self.ratio.samples_per_train_step)
        return Experience(tuple(admitted), self._state_after(state, landed), landed=tuple(landed),
                          train_steps=train_steps, collect_seconds=waited,
                          metrics=self._metrics(state.version, landed, ages))

    def drained(self) -> bool:
        started = self.submitted_steps >= 0
        budget_collected = started and self.submitted_steps >= self.total_env_steps
        return budget_collected and not self.in_flight and self._owed_train_steps() == 0

    def _owed_train_steps(self) -> int:
        owed = self.book.owed_samples(self.ratio.samples_per_insert)
        return max(math.floor(owed / self.ratio.samples_per_train_step), 0)

    def _may_collect(self) -> bool:
        """Under the budget, and the learner at most one round of chunks behind its ratio."""
        allowance = self.ratio.samples_per_insert * self.plan.preset.steps_per_chunk * self.plan.workers
        return (self.submitted_steps < self.total_env_steps
                and self.book.owed_samples(self.ratio.samples_per_insert) <= allowance)

    def _state_after(self, state: LoopState, landed: list[ShardRef]) -> LoopState:
        # a resumed run collects again what is in flight now: from each worker's last landed chunk
        next_chunk = tuple(n - (1 if w in self.in_flight else 0) for w, n in enumerate(self.next_chunk))
        return replace(state, env_steps=state.env_steps + sum(shard.env_steps for shard in landed),
                       env_cursors=tuple(self.cursors), stream=StreamPosition(next_chunk, self.book.counts))

    def _metrics(self, version: int, landed: list[ShardRef], ages: list[float]) -> dict[str, float]:
        lags = [version - shard.version for shard in landed]
        counts = self.book.counts
        (began, inserted_steps, sampled), now = self._period, time.perf_counter()
        self._period = (now, counts.inserted_steps, counts.sampled)
        metrics = {
            "async/inserts_per_second": (counts.inserted_steps - inserted_steps) / (now - began),
            "async/samples_per_second": (counts.sampled - sampled) / (now - began),
            "async/shards_inserted": float(counts.shards_inserted),
            "async/shards_dropped": float(counts.shards_dropped),
            "async/samples_per_insert": counts.sampled / max(counts.inserted_steps, 1),
            "async/workers_collecting": float(len(self.in_flight)),
        }
        if lags:
            metrics |= {"async/policy_lag_mean": float(np.mean(lags)), "async/policy_lag_max": float(max(lags))}
        if ages:
            metrics["async/shard_age_seconds"] = float(np.mean(ages))
        return metrics | collecting_rate(landed)


def collecting_rate(landed: list[ShardRef]) -> dict[str, float]:
    """A worker's own env steps a second while it collects (the landed chunks' mean): what the
    workers could give a learner that kept up with them."""
    rates = [shard.env_steps / shard.collect_seconds for shard in landed if shard.collect_seconds > 0]
    return {"async/worker_env_steps_per_second": float(np.mean(rates))} if rates else {}
