"""ASYNC collection for on-policy learners (APPO, IMPALA): the learner takes batches as they land,
and no rollout worker waits for it.

The stream keeps one chunk in flight per rollout worker, as the off-policy stream does
(tasks/training/stream.py: the same chunks, shards, ledger, retries and resume), but a thread of
its own tends the workers while the learner learns: a chunk that lands is put aside for the
learner and its worker gets its next chunk at once, acting with the newest committed version.
`collect` hands the learner what has landed once it makes a batch (`Batches.batch_steps` env
steps: by default a chunk from each worker), so the learner never waits for a round and the
workers never wait for the learner. Workers pause only while a whole batch is already waiting,
which bounds how far behind the learner their versions can fall; a shard collected by a version
more than `max_policy_lag` behind is dropped and counted. V-trace (agents/vtrace.py) corrects for
the lag of what is admitted.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np

from gymflow.agents.batches import Rollout
from gymflow.logs import AnyLogger
from gymflow.tasks.cluster.hosts import Hosts, wait_first
from gymflow.tasks.cluster.rounds import RoundPlan
from gymflow.tasks.storage.shards import ShardRef, read_shard
from gymflow.tasks.training.collection import Experience, Exploration
from gymflow.tasks.training.state import LoopState, StreamPosition
from gymflow.tasks.training.stream import Batches, ChunkStream, collecting_rate

TEND_POLL_S = 0.05  # how often the tending thread looks at the workers when nothing lands
# how long a cancel waits for the tending thread; one inside a cluster wait (a lost scheduler: up to
# 120 s) is left to end by itself, touching nothing once it sees the stop
CANCEL_WAIT_S = 2.0


class BatchStream(ChunkStream):
    """One chunk in flight per rollout worker, tended on a thread; see the module's docstring."""

    def __init__(self, hosts: Hosts, plan: RoundPlan, batches: Batches, exploration: Exploration, logger: AnyLogger):
        super().__init__(hosts, plan, exploration, logger, replay_window=0)
        self.batches = batches
        self.waiting: list[ShardRef] = []  # landed, not yet handed to the learner, in landing order
        self.read_ahead: dict[str, Rollout] = {}  # the waiting shards' contents, read (and checked) on the thread
        self.reading: list[ShardRef] = []  # landed, being read: neither in flight nor waiting
        self.submitting: set[int] = set()  # workers whose next chunk is being sent: not yet in flight
        self._lock = threading.Condition()  # the tending thread and the loop's share the stream's counters
        self._stopping = threading.Event()
        self._tender: threading.Thread | None = None
        self._failure: BaseException | None = None  # a chunk that failed for good, raised by `collect`

    def _start_from(self, state: LoopState) -> None:
        if self.submitted_steps >= 0:
            return
        super()._start_from(state)
        self._tender = threading.Thread(target=self._tend, name="gymflow-batch-stream", daemon=True)
        self._tender.start()

    def collect(self, state: LoopState) -> Experience:
        """The shards that have landed, once they make a batch (or once nothing more can land);
        each learned from or dropped by the lag bound against `state.version`."""
        self._start_from(state)
        started = time.perf_counter()
        with self._lock:
            while not self._batch_ready():
                self._raise_failure()
                self._lock.wait(1.0)
            self._raise_failure()
            landed, self.waiting = self.waiting, []
            contents = [self.read_ahead.pop(shard.key) for shard in landed]
            self._lock.notify_all()  # the workers paused for a full batch may go on
        waited = time.perf_counter() - started
        for shard in landed:
            self.book.record(shard, state.version - shard.version, self.batches.admits(shard.version, state.version))
        admitted = [(shard, rollout) for shard, rollout in zip(landed, contents, strict=True)
                    if self.batches.admits(shard.version, state.version)]
        shards = tuple(shard for shard, _ in admitted)
        return Experience(shards, self._state_after(state, landed), landed=tuple(landed), collect_seconds=waited,
                          metrics=self._metrics(state.version, landed, [time.time() - s.written_at for s in shards]),
                          read_ahead=tuple(rollout for _, rollout in admitted))

    def drained(self) -> bool:
        with self._lock:
            budget_collected = self.submitted_steps >= self.total_env_steps
            nothing_left = not (self.in_flight or self.submitting or self.reading or self.waiting)
            return self.submitted_steps >= 0 and budget_collected and nothing_left

    def cancel(self) -> None:
        """Within seconds, as a Prefect cancellation wants: the tending thread is not waited for
        past `CANCEL_WAIT_S` (it may be inside a wait for the cluster)."""
        self._stop_tending(CANCEL_WAIT_S)
        with self._lock:
            super().cancel()

    def _stop_collecting(self) -> list[ShardRef]:
        self._stop_tending(None)  # the run's end: `finish` settles what is in flight after it
        late, self.waiting = self.waiting, []
        self.read_ahead.clear()
        return late

    def _stop_tending(self, wait_s: float | None) -> None:
        self._stopping.set()
        with self._lock:
            self._lock.notify_all()
        if self._tender is not None and self._tender is not threading.current_thread():
            self._tender.join(wait_s)

    def _tend(self) -> None:
        """The tending thread: whatever lands is read (its sha256 checked) and put aside for the
        learner, and its worker gets its next chunk at once (while less than a batch waits and
        the budget lasts). The lock is held only for the bookkeeping: what can wait (settling a
        call, which waits for a lost scheduler or for workers; sending a chunk, which may wait for a
        host to start; reading a shard) happens outside it, so the learner takes what has landed
        and a cancel returns meanwhile."""
        while not self._stopping.is_set():
            with self._lock:
                calls = dict(self.in_flight)
                if not calls:  # every worker paused: woken as soon as the learner takes a batch
                    self._lock.wait(TEND_POLL_S)
            if calls:
                wait_first(calls.values(), TEND_POLL_S)
            try:
                settled = self._settled(calls)
                with self._lock:
                    if self._stopping.is_set():
                        return
                    arrived = self.reading = self._take_landed(settled)
                    chunks = self._next_chunks(self.submitted_steps)
                    self.submitting = set(chunks)
                sent = self._submitted(chunks)
                with self._lock:
                    self.submitting = set()
                    if self._stopping.is_set():
                        return  # sent after the stop: they finish on their workers, never read
                    self.in_flight |= sent
                contents = {shard.key: read_shard(self.storage, shard) for shard in arrived}
            except BaseException as failure:  # noqa: BLE001 (handed to the loop's thread, raised there)
                with self._lock:
                    self.submitting = set()
                    self._failure = failure
                    self._lock.notify_all()
                return
            with self._lock:
                self.read_ahead |= contents
                self.waiting += arrived
                self.reading = []
                self._lock.notify_all()

    def _batch_ready(self) -> bool:
        waiting = sum(shard.env_steps for shard in self.waiting)
        nothing_coming = not self.in_flight and not self.submitting and not self.reading
        return waiting >= self.batches.batch_steps or (nothing_coming and self._budget_submitted())

    def _budget_submitted(self) -> bool:
        return self.submitted_steps >= 0 and self.submitted_steps >= self.total_env_steps

    def _may_collect(self) -> bool:
        """Under the budget, and less than a batch waiting for the learner."""
        waiting = sum(shard.env_steps for shard in self.waiting + self.reading)
        return self.submitted_steps < self.total_env_steps and waiting < self.batches.batch_steps

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _state_after(self, state: LoopState, landed: list[ShardRef]) -> LoopState:
        """The state once `landed` is learned from: a resumed run collects again from each
        worker's last shard the learner took (what was waiting or in flight is collected anew)."""
        stream = state.stream or StreamPosition.start(self.plan.workers)
        next_chunk, cursors = list(stream.next_chunk), list(state.env_cursors)
        for shard in sorted(landed, key=lambda shard: shard.chunk or 0):
            next_chunk[shard.worker], cursors[shard.worker] = (shard.chunk or 0) + 1, shard.key
        return replace(state, env_steps=state.env_steps + sum(shard.env_steps for shard in landed),
                       env_cursors=tuple(cursors), stream=StreamPosition(tuple(next_chunk), self.book.counts))

    def _metrics(self, version: int, landed: list[ShardRef], ages: list[float]) -> dict[str, float]:
        counts = self.book.counts
        metrics = {"async/shards_inserted": float(counts.shards_inserted),
                   "async/shards_dropped": float(counts.shards_dropped),
                   "async/batch_shards": float(len(landed)),
                   "async/workers_collecting": float(len(self.in_flight))}
        if landed:
            lags = [version - shard.version for shard in landed]
            metrics |= {"async/policy_lag_mean": float(np.mean(lags)), "async/policy_lag_max": float(max(lags))}
        if ages:
            metrics["async/shard_age_seconds"] = float(np.mean(ages))
        return metrics | collecting_rate(landed)
