"""The ASYNC ledger: every shard that landed and what became of it, kept at constant cost.

The loop's state holds only counters (`Ledger`). The per-shard records go to append-only
segments, one per checkpoint (`ledger/v000123.json`: the shards that landed since the previous
checkpoint), so no object rewritten at a commit grows with the run. In memory the stream keeps
the records since the last segment and the inserted shards whose transitions the replay memory
may still hold (`LedgerBook.recent`), both bounded.

A resumed run rebuilds its replay memory from the newest inserted shards, read back from the
segments newest first until they cover the memory's capacity (`replay_tail`).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace

from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage
from gymflow.tasks.storage.shards import ShardRef

FINAL_LEDGER = "ledger.json"  # an ASYNC run's counters and unused shards, beside its preset


@dataclass(frozen=True)
class Ledger:
    """The ledger's counters: what the loop's state carries, whatever the run's length."""

    shards_inserted: int = 0
    shards_dropped: int = 0  # collected by a policy more versions behind than the lag bound
    shards_unused: int = 0  # landed after the run had stopped
    inserted_steps: int = 0  # transitions inserted into replay (heatup excluded)
    sampled: int = 0  # transitions sampled for training (train steps x batch size)
    lag_sum: int = 0  # learner version minus the shard's, summed over inserted and dropped shards
    lag_max: int = 0

    @property
    def lag_mean(self) -> float:
        landed = self.shards_inserted + self.shards_dropped
        return self.lag_sum / landed if landed else 0.0


@dataclass(frozen=True)
class LedgerRecord:
    """One landed shard."""

    key: str
    worker: int
    chunk: int
    env_steps: int
    lag: int  # learner version minus the shard's when it landed
    admitted: bool  # inserted into replay; else dropped by the lag bound


@dataclass
class _Recent:
    record: LedgerRecord
    segment: int | None  # the segment it is written in; None until the next checkpoint


class LedgerBook:
    """The ledger while the stream writes it: counters, the records not yet in a segment, and the
    newest inserted shards that cover `replay_window` transitions."""

    def __init__(self, counts: Ledger, replay_window: int, recent: list[tuple[LedgerRecord, int]] = ()):
        self.counts = counts
        self.replay_window = replay_window
        self.pending: list[LedgerRecord] = []
        self.recent: deque[_Recent] = deque(_Recent(record, segment) for record, segment in recent)
        self._recent_steps = sum(entry.record.env_steps for entry in self.recent)

    def record(self, shard: ShardRef, lag: int, admitted: bool) -> None:
        assert shard.chunk is not None, "an async shard knows its chunk number"
        record = LedgerRecord(shard.key, shard.worker, shard.chunk, shard.env_steps, lag, admitted)
        self.pending.append(record)
        counts = self.counts
        self.counts = replace(
            counts, shards_inserted=counts.shards_inserted + admitted,
            shards_dropped=counts.shards_dropped + (not admitted),
            inserted_steps=counts.inserted_steps + (shard.env_steps if admitted else 0),
            lag_sum=counts.lag_sum + lag, lag_max=max(counts.lag_max, lag),
        )
        if admitted and self.replay_window:
            self._remember_recent(_Recent(record, None))

    def add_sampled(self, samples: int) -> None:
        self.counts = replace(self.counts, sampled=self.counts.sampled + samples)

    def add_unused(self, shards: list[ShardRef]) -> None:
        self.counts = replace(self.counts, shards_unused=self.counts.shards_unused + len(shards))

    def owed_samples(self, samples_per_insert: float) -> float:
        return samples_per_insert * self.counts.inserted_steps - self.counts.sampled

    def write_segment(self, storage: Storage, layout: RunLayout, version: int) -> None:
        """The records since the last segment, as segment `version` (none if nothing landed)."""
        if not self.pending:
            return
        storage.write(layout.ledger_segment(version), json.dumps([asdict(r) for r in self.pending]).encode())
        self.pending = []
        for entry in reversed(self.recent):
            if entry.segment is not None:
                break
            entry.segment = version

    @property
    def replay_covered(self) -> bool:
        """The recent inserted shards cover the replay window: heatup's have been overwritten."""
        return self._recent_steps >= self.replay_window

    def _remember_recent(self, entry: _Recent) -> None:
        self.recent.append(entry)
        self._recent_steps += entry.record.env_steps
        while self._recent_steps - self.recent[0].record.env_steps >= self.replay_window:
            self._recent_steps -= self.recent.popleft().record.env_steps


def read_segment(storage: Storage, layout: RunLayout, version: int) -> list[LedgerRecord]:
    return [LedgerRecord(**fields) for fields in json.loads(storage.read(layout.ledger_segment(version)))]


def segment_versions(storage: Storage, layout: RunLayout) -> list[int]:
    """Versions of the stored segments, oldest first."""
    names = (key.rsplit("/", 1)[1] for key in storage.list(layout.ledger))
    return sorted(int(name[1:-5]) for name in names if name.startswith("v") and name.endswith(".json"))


def records_newest_first(storage: Storage, layout: RunLayout, through: int) -> Iterator[tuple[LedgerRecord, int]]:
    """Every stored record up to checkpoint `through`, newest first, with its segment's version."""
    for version in reversed([v for v in segment_versions(storage, layout) if v <= through]):
        for record in reversed(read_segment(storage, layout, version)):
            yield record, version


def replay_tail(storage: Storage, layout: RunLayout, through: int, window: int) -> list[tuple[LedgerRecord, int]]:
    """The newest inserted shards up to checkpoint `through` that cover `window` transitions,
    oldest first: what the replay memory held, unless the run is younger than the window."""
    tail, steps = [], 0
    if window:
        for record, version in records_newest_first(storage, layout, through):
            if steps >= window:
                break
            if record.admitted:
                tail.append((record, version))
                steps += record.env_steps
    return tail[::-1]


def discard_segments_after(storage: Storage, layout: RunLayout, version: int) -> None:
    """A resumed run drops the segments of checkpoints newer than the one it resumes from."""
    storage.delete(layout.ledger_segment(v) for v in segment_versions(storage, layout) if v > version)


def write_final_ledger(storage: Storage, run_id: str, counts: Ledger, unused: list[ShardRef]) -> None:
    document = {"counts": asdict(counts), "unused": [shard.key for shard in unused]}
    storage.write(f"{RunLayout(run_id).prefix}/{FINAL_LEDGER}", json.dumps(document, indent=1).encode())
