"""Decisions a served policy took, and what came of them, logged in a run's storage (a folder or a
bucket) for learning and off-policy evaluation (agents/ope.py) without a simulator.

A decision: a request id, the observation, the action, its log-probability under the policy that
acted (a log-density for continuous actions), the policy's name and version, the time. An outcome
arrives later under the decision's request id: the reward, the next observation, whether the episode
ended. Both are buffered and written as shards of their own (npz, no pickles), append-only: a shard's
key is new each time (`<prefix>/decisions/<time>-<uuid>-<sha256 prefix>.npz`, outcomes alike), never
overwritten, its content checked against the hash in its name when read. Logging never fails or
holds up the caller: a serving process's log writes from a thread of its own (`start`), and a shard
that cannot be written, or records beyond what may wait in memory, are dropped and counted. With a
retention, that thread also deletes the shards older than it, by the time in their names.
`read_logged` joins decisions with their outcomes by request id.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import fsspec
import numpy as np

from gymflow.errors import GymflowError
from gymflow.presets.model import StorageConfig
from gymflow.tasks.storage.codec import decode_arrays, encode_arrays
from gymflow.tasks.storage.objects import Storage, StorageLocation

SHARD_RECORDS = 1_000  # records a shard holds at most: written once this many are buffered
LOGGER = logging.getLogger("gymflow.decisions")
Columns = dict[str, np.ndarray]  # records as arrays, a field each, rows first
PRUNE_EVERY_S = 3600.0  # how often a serving process deletes the shards past its retention
MOST_WAITING = 200_000  # records of a kind that may wait in memory for a store that is behind; more are dropped
MOST_WAITING_BYTES = 512 * 2**20  # and the bytes they may take (an Atari frame stack: 28 KB a record)


@dataclass(frozen=True)
class Decision:
    request_id: str
    observation: np.ndarray
    action: int | np.ndarray  # a continuous action: the policy's sample, before the env's bounds clip it
    log_probability: float  # of `action` under the policy that acted (a log-density where continuous)
    policy: str
    version: int
    at: float  # time.time()


@dataclass(frozen=True)
class Outcome:
    request_id: str
    reward: float
    next_observation: np.ndarray
    terminal: bool
    at: float


@dataclass(frozen=True)
class LoggedDecisions:
    """The decisions whose outcome arrived, in the order they were taken, as arrays."""

    request_ids: np.ndarray  # [N] str
    observations: np.ndarray  # [N, *obs]
    actions: np.ndarray  # [N] or [N, *action shape]
    log_probabilities: np.ndarray  # [N]
    rewards: np.ndarray  # [N]
    next_observations: np.ndarray  # [N, *obs]
    terminal: np.ndarray  # [N] bool
    versions: np.ndarray  # [N] int
    without_outcome: int  # decisions whose outcome has not arrived (left out)


class DecisionLog:
    """The writer a serving process keeps: thread-safe, append-only, never raising to its callers.
    Without `start`, a full shard is written by the call that fills it and the rest by `flush`."""

    def __init__(self, storage: Storage, prefix: str, shard_records: int = SHARD_RECORDS,
                 most_waiting: int = MOST_WAITING):
        self.storage, self.prefix, self.shard_records = storage, prefix.rstrip("/"), shard_records
        self.most_waiting = most_waiting
        self._lock = threading.Lock()
        self._pending: dict[str, list[Columns]] = {"decisions": [], "outcomes": []}
        self.written = {"decisions": 0, "outcomes": 0}
        self.dropped = {"decisions": 0, "outcomes": 0}
        self.pruned = 0  # shards deleted as older than the retention
        self._waiting = {"decisions": [0, 0], "outcomes": [0, 0]}  # rows and bytes waiting to be written
        self._writer: threading.Thread | None = None
        self._wake, self._stopping = threading.Event(), threading.Event()

    def decided(self, decision: Decision) -> None:
        self._add("decisions", _arrays([decision]))

    def decided_together(self, decisions: Columns) -> None:
        """A batch of decisions at once, as columns (Decision's fields, each [N, ...])."""
        self._add("decisions", decisions)

    def observed(self, outcome: Outcome) -> None:
        self._add("outcomes", _arrays([outcome]))

    def start(self, every_s: float, retention_s: float | None = None) -> None:
        """Write from a thread of this log's own: a full shard at once, the rest every `every_s`; and
        where `retention_s` is given, delete the shards older than that at once and every hour."""
        self._writer = threading.Thread(target=self._write_behind, args=(every_s, retention_s), daemon=True,
                                        name="gymflow-decision-log")
        self._writer.start()

    def prune(self, retention_s: float) -> int:
        """Delete the shards (decisions and outcomes) written more than `retention_s` ago, by the time in
        their names; how many. A store that fails here is left as it is until the next try."""
        cutoff = time.time() - retention_s
        try:
            old = [key for kind in self._pending for key in self.storage.list(_under(self.prefix, kind))
                   if _written_at(key) < cutoff]
            self.storage.delete(old)
        except Exception:  # noqa: BLE001 - pruning never fails the serving process; the next hour tries again
            return 0
        return len(old)

    def close(self) -> None:
        """Stop the writing thread, if any, and write whatever is buffered."""
        self._stopping.set()
        self._wake.set()
        if self._writer is not None:
            self._writer.join()
        self.flush()

    def flush(self) -> None:
        """Write whatever is buffered, in shards of at most `shard_records`."""
        for kind in self._pending:
            with self._lock:
                chunks, self._pending[kind] = self._pending[kind], []
                self._waiting[kind] = [0, 0]
            self._write_shards(kind, chunks)

    def _write_shards(self, kind: str, chunks: list[Columns]) -> None:
        if not chunks:
            return
        columns = {name: np.concatenate([chunk[name] for chunk in chunks]) for name in chunks[0]}
        rows = _rows(columns)
        for start in range(0, rows, self.shard_records):
            if not self._write(kind, {name: values[start:start + self.shard_records]
                                      for name, values in columns.items()}):
                with self._lock:  # the store refused one shard: the rest would wait as long, for as little
                    self._count_dropped(kind, max(0, rows - start - self.shard_records),
                                        "the store refused a shard before them")
                break

    def _count_dropped(self, kind: str, count: int, why: str) -> None:
        """Count records lost (under the lock); said on the log's logger at the first loss and at every
        10,000th after, so a serving process's output shows what the log is missing."""
        before = self.dropped[kind]
        self.dropped[kind] += count
        if count and (before == 0 or before // 10_000 != self.dropped[kind] // 10_000):
            LOGGER.warning("decision log %s: %d %s dropped so far (%s)", self.storage.url(self.prefix),
                           self.dropped[kind], kind, why)

    def _write_behind(self, every_s: float, retention_s: float | None) -> None:
        pruned_at = -math.inf
        while not self._stopping.is_set():
            if retention_s is not None and time.monotonic() - pruned_at >= PRUNE_EVERY_S:
                self.pruned += self.prune(retention_s)
                pruned_at = time.monotonic()
            self._wake.wait(every_s)
            self._wake.clear()
            self.flush()

    def _add(self, kind: str, chunk: Columns) -> None:
        rows, size = _rows(chunk), sum(values.nbytes for values in chunk.values())
        with self._lock:
            waiting_rows, waiting_bytes = self._waiting[kind]
            if waiting_rows + rows > self.most_waiting or waiting_bytes + size > MOST_WAITING_BYTES:
                self._count_dropped(kind, rows, "the store is behind and what waits for it is at its bound")
                return  # memory stays bounded
            self._pending[kind].append(chunk)
            self._waiting[kind] = [waiting_rows + rows, waiting_bytes + size]
            full = waiting_rows + rows >= self.shard_records
            chunks = self._pending[kind] if full and self._writer is None else []
            if chunks:
                self._pending[kind], self._waiting[kind] = [], [0, 0]
        if full and self._writer is not None:
            self._wake.set()
        elif chunks:
            self._write_shards(kind, chunks)

    def _write(self, kind: str, columns: Columns) -> bool:
        """Whether the shard was written; one that was not is counted dropped."""
        rows = _rows(columns)
        if not rows:
            return True
        try:
            data = encode_arrays(columns)
            digest = hashlib.sha256(data).hexdigest()[:16]
            key = _under(self.prefix, f"{kind}/{time.time():.6f}-{uuid.uuid4().hex}-{digest}.npz")
            self.storage.write(key, data)
        except Exception as error:  # noqa: BLE001 - logging never fails the prediction it records: counted lost
            with self._lock:
                self._count_dropped(kind, rows, f"{type(error).__name__}: {error}".splitlines()[0])
            return False
        with self._lock:
            self.written[kind] += rows
        return True


def open_decision_log(url: str, outage_budget_s: float = 30.0) -> DecisionLog:
    """The log under a folder or a bucket's URL (s3://bucket/serving/cartpole), credentials from the
    environment, as gymflow's storage takes them: what a serving process and an outcome reporter open."""
    return DecisionLog(Storage(StorageLocation(url, outage_budget_s=outage_budget_s)), "")


HeldOutPart = Literal["all", "selection", "judging"]


def held_out(request_ids: np.ndarray, share: float, part: HeldOutPart = "all") -> np.ndarray:
    """[N] bool: the decisions kept out of learning for off-policy evaluation, `share` of them, chosen
    by their request id's hash (the same ids, the same choice, wherever it is made). Its first half
    is the `selection` part (what a run's evaluations choose its delivered version on), its second
    the `judging` part (what a retraining's judge weighs, apart from what chose the challenger)."""
    return held_out_of(request_buckets(request_ids), share, part)


def request_buckets(request_ids: np.ndarray) -> np.ndarray:
    """[N] each request id's hash as a number in [0, 1): where `held_out` places it."""
    return np.asarray([int.from_bytes(hashlib.sha256(str(request).encode()).digest()[:4], "big")
                       for request in request_ids], dtype=np.float64) / 2**32


def held_out_of(buckets: np.ndarray, share: float, part: HeldOutPart = "all") -> np.ndarray:
    """`held_out` of ids already hashed (`request_buckets`)."""
    low, high = {"all": (0.0, share), "selection": (0.0, share / 2), "judging": (share / 2, share)}[part]
    return (buckets >= low) & (buckets < high)


def logged_part(logged: LoggedDecisions, rows: np.ndarray) -> LoggedDecisions:
    """The decisions at `rows` (a mask or indices)."""
    return LoggedDecisions(*(getattr(logged, name)[rows] for name in LoggedDecisions.__dataclass_fields__
                             if name != "without_outcome"), logged.without_outcome)


def _rows(columns: Columns) -> int:
    return len(next(iter(columns.values()))) if columns else 0


def _written_at(key: str) -> float:
    """The unix time a shard's name begins with (`<time>-<uuid>-<hash>.npz`); a key of another name
    counts as new (never pruned)."""
    try:
        return float(key.rsplit("/", 1)[-1].split("-", 1)[0])
    except ValueError:
        return math.inf


def _under(prefix: str, rest: str) -> str:
    return f"{prefix.strip('/')}/{rest}" if prefix.strip("/") else rest


def _arrays(records: list) -> dict[str, np.ndarray]:
    """A shard's arrays: a column a field."""
    fields = records[0].__dataclass_fields__
    return {name: np.asarray([getattr(record, name) for record in records]) for name in fields}


def read_logged(storage: Storage, prefix: str, before: float | None = None) -> LoggedDecisions:
    """Every decision under `prefix` whose outcome arrived, joined by request id (the first outcome of
    an id counts); with `before` (unix time), only decisions and outcomes logged before it, so readers
    at different moments of a live log read the same. A shard whose content does not match its name
    is refused in one line."""
    decisions, outcomes = (_before(_read_kind(storage, _under(prefix, kind)), before)
                           for kind in ("decisions", "outcomes"))
    if not decisions or not len(decisions["at"]):
        raise GymflowError("decisions", f"no logged decisions under {storage.url(prefix)}")
    order = np.argsort(decisions["at"], kind="stable")
    decisions = {name: values[order] for name, values in decisions.items()}
    found = {request: row for row, request in reversed(list(enumerate(outcomes.get("request_id", []))))}
    rows = np.array([found.get(request, -1) for request in decisions["request_id"]], dtype=np.int64)
    kept = rows >= 0
    joined = rows[kept]
    return LoggedDecisions(
        decisions["request_id"][kept], decisions["observation"][kept], decisions["action"][kept],
        decisions["log_probability"][kept], outcomes["reward"][joined] if len(joined) else np.zeros(0),
        outcomes["next_observation"][joined] if len(joined) else decisions["observation"][:0],
        outcomes["terminal"][joined] if len(joined) else np.zeros(0, bool), decisions["version"][kept],
        int((~kept).sum()))


def _before(records: dict[str, np.ndarray], before: float | None) -> dict[str, np.ndarray]:
    if before is None or not records:
        return records
    kept = records["at"] < before
    return {name: values[kept] for name, values in records.items()}


def decision_log_location(url: str, options: Mapping[str, Any], storage: StorageConfig) -> StorageLocation:
    """Where a decision log is read from: a relative folder as an absolute path (workers elsewhere
    find it too); its own options, else the run's storage options (with their block's credentials)
    where the log is on the same kind of store."""
    root = url if "://" in url else os.path.abspath(url)
    same_store = fsspec.utils.get_protocol(url) == fsspec.utils.get_protocol(storage.root)
    chosen = dict(options) or (dict(storage.options) if same_store else {})
    return StorageLocation(root, chosen, storage.outage_budget_s)


def _read_kind(storage: Storage, prefix: str) -> dict[str, np.ndarray]:
    """Every shard of one kind, its records concatenated; each checked against the hash in its name."""
    parts: list[dict[str, np.ndarray]] = []
    for key in sorted(storage.list(prefix)):
        data = storage.read(key)
        if not key.endswith(f"-{hashlib.sha256(data).hexdigest()[:16]}.npz"):
            raise GymflowError("decisions", f"{storage.url(key)} does not hold what was written there")
        parts.append(decode_arrays(data))
    if not parts:
        return {}
    return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
