"""ASYNC collection: every rollout worker always has its next chunk on the way.

The flow's process keeps one chunk job in flight per rollout worker. A chunk acts with the
newest committed policy version when it starts, continues its worker's envs from the previous
chunk, and writes one shard tagged with the version it used. As a chunk lands, the worker's next
one is submitted at once (unless the learner has fallen behind its ratio: then collection waits,
as a Reverb rate limiter would). Chunks go to the workers' job hosts (tasks/hosts.py). A chunk
whose worker process dies is sent again under the same key to a live worker; a chunk running
past the deadline is treated as wedged, its worker restarted and the chunk sent again. Every
chunk lands once, in the `Ledger`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from prefect import get_run_logger

from envs.seeding import derive_seed
from presets.model import Preset
from tasks.hosts import ATTEMPTS, Call, HostPool, wait_first
from tasks.jobs import RolloutSpec, run_rollout
from tasks.shards import ShardRef
from tasks.storage import RunLayout, Storage, StorageLocation


@dataclass
class Ledger:
    """Every async shard that landed, in landing order, and what became of it. Stored in each
    checkpoint's counters, so a resumed run rebuilds its replay memory from `inserted`."""

    inserted: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # collected by a policy too far behind
    unused: list[str] = field(default_factory=list)  # landed after the run had stopped
    lags: dict[str, int] = field(default_factory=dict)  # key -> learner version minus the shard's
    inserted_steps: int = 0  # transitions inserted into replay (heatup excluded)
    sampled: int = 0  # transitions sampled for training (train steps x batch size)

    def as_dict(self) -> dict:
        return {"inserted": self.inserted, "dropped": self.dropped, "unused": self.unused, "lags": self.lags,
                "inserted_steps": self.inserted_steps, "sampled": self.sampled}

    @classmethod
    def from_dict(cls, data: dict | None) -> Ledger:
        return cls(**data) if data else cls()


LEDGER = "ledger.json"


def write_ledger(storage: Storage, run_id: str, ledger: Ledger) -> None:
    """The run's final accounting of its async shards, next to its preset."""
    storage.write(f"{RunLayout(run_id).prefix}/{LEDGER}", json.dumps(ledger.as_dict(), indent=1).encode())


def read_ledger(storage: Storage, run_id: str) -> Ledger:
    return Ledger.from_dict(json.loads(storage.read(f"{RunLayout(run_id).prefix}/{LEDGER}")))


def admits(shard_version: int, learner_version: int, max_policy_lag: int) -> bool:
    """The lag bound: a shard is inserted only if its policy is at most `max_policy_lag` versions
    behind the learner's newest committed one."""
    return learner_version - shard_version <= max_policy_lag


class RolloutStream:
    """One chunk in flight per rollout worker; see the module's docstring."""

    def __init__(
        self, hosts: HostPool, preset: Preset, run_id: str, location: StorageLocation,
        next_chunk: Sequence[int], resume_from: Sequence[str | None],
    ):
        self.hosts, self.preset, self.run_id, self.location = hosts, preset, run_id, location
        self.next_chunk = list(next_chunk)  # per worker: the next chunk number to submit
        self.resume_from = list(resume_from)  # per worker: the last landed shard, whose envs continue
        self.in_flight: dict[int, Call] = {}
        self.submitted_steps = 0  # env steps of every chunk submitted by this stream

    @property
    def workers(self) -> int:
        return self.preset.distribution.rollout_workers

    def idle_workers(self) -> list[int]:
        return [w for w in range(self.workers) if w not in self.in_flight]

    def submit(self, worker: int, exploration: float) -> None:
        """Send `worker` its next chunk; it continues from the worker's last landed shard."""
        chunk = self.next_chunk[worker]
        spec = RolloutSpec(
            storage=self.location, run_id=self.run_id, env_id=self.preset.env.id, env_kwargs=dict(self.preset.env.kwargs),
            agent=self.preset.agent, policy_version="newest", worker=worker,
            num_envs=self.preset.distribution.envs_per_worker, steps_per_env=self.preset.schedule.rollout_steps_per_env,
            env_seed=derive_seed(self.preset.seed, "envs", worker),
            policy_seed=derive_seed(self.preset.seed, "policy", "async", worker, chunk),
            exploration=exploration, resume_from=self.resume_from[worker], chunk=chunk,
        )
        self.in_flight[worker] = self.hosts.call(run_rollout, spec, slot=worker)
        self.next_chunk[worker] += 1
        self.submitted_steps += self.preset.steps_per_chunk

    def landed(self, wait_s: float = 0.0) -> list[ShardRef]:
        """The chunks that finished, waiting up to `wait_s` for the first one. A failed chunk
        raises; a lost or wedged one is sent again."""
        if not any(call.done() for call in self.in_flight.values()):
            wait_first(self.in_flight.values(), wait_s)
        refs = []
        for worker, call in sorted(self.in_flight.items(), key=lambda item: item[1].deadline):
            call = self.in_flight[worker] = self.hosts.settle(call, get_run_logger())
            if call.finished:
                ref = call.future.result()  # a chunk that failed for good raises here
                del self.in_flight[worker]
                self.resume_from[worker] = ref.key
                refs.append(ref)
        return refs

    def stop(self) -> list[ShardRef]:
        """Submit nothing more and wait for the chunks in flight; returns them. Afterwards no
        chunk of this run is queued or running anywhere."""
        refs = []
        deadline = time.monotonic() + self.hosts.timeout_s * ATTEMPTS
        while self.in_flight:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.in_flight)} rollout chunks did not finish after the stop")
            refs += self.landed(wait_s=1.0)
        return refs

    def cancel(self) -> None:
        """Give up on the chunks in flight (the run failed); a chunk already running finishes
        on its worker, and its shard is never read."""
        self.in_flight.clear()
