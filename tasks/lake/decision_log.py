"""Decisions a served policy took, and what came of them, logged in a run's storage (a folder or a
bucket) for learning and off-policy evaluation (agents/ope.py) without a simulator.

A decision: a request id, the observation, the action, its probability under the policy that acted
(a density for continuous actions), the policy's name and version, the time. An outcome arrives
later under the decision's request id: the reward, the next observation, whether the episode ended.
Both are buffered and written as shards of their own (npz, no pickles), append-only: a shard's key is
new each time (`<prefix>/decisions/<time>-<uuid>-<sha256 prefix>.npz`, outcomes alike), never
overwritten, its content checked against the hash in its name when read. Logging never fails the
caller: a shard that cannot be written is dropped and counted. `read_logged` joins decisions with
their outcomes by request id.
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np

from gymflow.errors import GymflowError
from gymflow.tasks.storage.codec import decode_arrays, encode_arrays
from gymflow.tasks.storage.objects import Storage

SHARD_RECORDS = 1_000  # records a shard holds at most: written once this many are buffered


@dataclass(frozen=True)
class Decision:
    request_id: str
    observation: np.ndarray
    action: int
    probability: float  # of `action` under the policy that acted
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
    actions: np.ndarray  # [N]
    probabilities: np.ndarray  # [N]
    rewards: np.ndarray  # [N]
    next_observations: np.ndarray  # [N, *obs]
    terminal: np.ndarray  # [N] bool
    versions: np.ndarray  # [N] int
    without_outcome: int  # decisions whose outcome has not arrived (left out)


class DecisionLog:
    """The writer a serving process keeps: thread-safe, append-only, never raising to its callers."""

    def __init__(self, storage: Storage, prefix: str, shard_records: int = SHARD_RECORDS):
        self.storage, self.prefix, self.shard_records = storage, prefix.rstrip("/"), shard_records
        self._lock = threading.Lock()
        self._pending: dict[str, list] = {"decisions": [], "outcomes": []}
        self.written = {"decisions": 0, "outcomes": 0}
        self.dropped = {"decisions": 0, "outcomes": 0}

    def decided(self, decision: Decision) -> None:
        self._add("decisions", decision)

    def observed(self, outcome: Outcome) -> None:
        self._add("outcomes", outcome)

    def flush(self) -> None:
        """Write whatever is buffered."""
        for kind in self._pending:
            with self._lock:
                records, self._pending[kind] = self._pending[kind], []
            self._write(kind, records)

    def _add(self, kind: str, record: Decision | Outcome) -> None:
        with self._lock:
            self._pending[kind].append(record)
            full = len(self._pending[kind]) >= self.shard_records
            records = self._pending[kind] if full else []
            if full:
                self._pending[kind] = []
        if records:
            self._write(kind, records)

    def _write(self, kind: str, records: list) -> None:
        if not records:
            return
        try:
            data = encode_arrays(_arrays(records))
            digest = hashlib.sha256(data).hexdigest()[:16]
            key = f"{self.prefix}/{kind}/{time.time():.6f}-{uuid.uuid4().hex}-{digest}.npz"
            self.storage.write(key, data)
        except Exception:  # noqa: BLE001 - logging never fails the prediction it records: the shard is counted lost
            with self._lock:
                self.dropped[kind] += len(records)
            return
        with self._lock:
            self.written[kind] += len(records)


def _arrays(records: list) -> dict[str, np.ndarray]:
    """A shard's arrays: a column a field."""
    fields = records[0].__dataclass_fields__
    return {name: np.asarray([getattr(record, name) for record in records]) for name in fields}


def read_logged(storage: Storage, prefix: str) -> LoggedDecisions:
    """Every decision under `prefix` whose outcome arrived, joined by request id (the first outcome of
    an id counts); a shard whose content does not match its name is refused in one line."""
    decisions, outcomes = (_read_kind(storage, f"{prefix.rstrip('/')}/{kind}") for kind in ("decisions", "outcomes"))
    if not decisions:
        raise GymflowError("decisions", f"no logged decisions under {storage.url(prefix)}")
    order = np.argsort(decisions["at"], kind="stable")
    decisions = {name: values[order] for name, values in decisions.items()}
    found = {request: row for row, request in reversed(list(enumerate(outcomes.get("request_id", []))))}
    rows = np.array([found.get(request, -1) for request in decisions["request_id"]], dtype=np.int64)
    kept = rows >= 0
    joined = rows[kept]
    return LoggedDecisions(
        decisions["request_id"][kept], decisions["observation"][kept], decisions["action"][kept],
        decisions["probability"][kept], outcomes["reward"][joined] if len(joined) else np.zeros(0),
        outcomes["next_observation"][joined] if len(joined) else decisions["observation"][:0],
        outcomes["terminal"][joined] if len(joined) else np.zeros(0, bool), decisions["version"][kept],
        int((~kept).sum()))


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
