"""Checks of what a finished run leaves in storage."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from gymflow.tasks.storage.checkpoints import (
    committed_versions,
    latest_version,
    read_checkpoint,
    read_policy,
    versions_on,
)
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage
from gymflow.tasks.training.ledger import FINAL_LEDGER, Ledger, read_segment, segment_versions


def check_run_storage(storage: Storage, summary, expect_heatup: bool = False) -> None:
    """What a finished run leaves in storage with the default retention."""
    layout = RunLayout(summary.run_id)
    final = summary.versions_committed - 1
    assert latest_version(storage, layout) == final
    checkpoints = committed_versions(storage, layout)  # the newest two (storage.keep_checkpoints), verified
    assert len(checkpoints) == 2 and checkpoints[-1] == final
    for version in checkpoints:
        blobs = read_checkpoint(storage, layout, version)
        assert {"policy.safetensors", "learner.safetensors", "learner.json", "loop_state.json"} <= set(blobs)
    policies = versions_on(storage, layout.policies)  # the newest, and max_policy_lag (4) + 1 behind it
    assert policies[-1] == final and len(policies) <= 6
    for version in policies:
        assert read_policy(storage, layout, version)
    # the shards left are those a resume from the oldest checkpoint reads (its envs' cursors) and later
    oldest = checkpoints[0]
    rounds = [f"v{v:06d}" for v in range(max(oldest - 1, 0), final)] + (["heatup"] if expect_heatup and not oldest
                                                                         else [])
    expected = sorted(f"{layout.prefix}/shards/{r}/w{w:03d}.npz" for r in rounds for w in (0, 1))
    assert storage.list(f"{layout.prefix}/shards") == expected  # one shard per (version, worker)


@dataclass(frozen=True)
class LedgerEntries:
    """A finished run's whole ledger, read back from its segments (all of them only where
    `storage.keep_shards: all` kept them): what the tests check."""

    inserted: tuple[str, ...]
    dropped: tuple[str, ...]
    unused: tuple[str, ...]
    lags: dict[str, int] = field(default_factory=dict)
    counts: Ledger = field(default_factory=Ledger)


def read_ledger(storage: Storage, run_id: str) -> LedgerEntries:
    layout = RunLayout(run_id)
    final = json.loads(storage.read(f"{layout.prefix}/{FINAL_LEDGER}"))
    records = [r for version in segment_versions(storage, layout) for r in read_segment(storage, layout, version)]
    return LedgerEntries(
        inserted=tuple(r.key for r in records if r.admitted), dropped=tuple(r.key for r in records if not r.admitted),
        unused=tuple(final["unused"]), lags={r.key: r.lag for r in records}, counts=Ledger(**final["counts"]),
    )


def newest_published(root: Path, run_id: str = "*") -> int:
    """The newest policy version a run under the local storage `root` (`run_id`'s; any: "*") has published so
    far (-1: none). A fast run retires old versions between two polls, so a wait for version N asks for "N or
    newer"."""
    versions = [int(manifest.parent.name[1:]) for manifest in root.glob(f"runs/{run_id}/policies/v*/manifest.json")]
    return max(versions, default=-1)


def check_every_chunk_once(storage: Storage, run_id: str, workers: int, max_policy_lag: int) -> LedgerEntries:
    """An ASYNC run's ledger: every chunk stored is accounted for once (admitted, dropped for lag
    or unused), no chunk number of a worker is missing, and no admitted chunk lagged past the bound."""
    layout = RunLayout(run_id)
    ledger = read_ledger(storage, run_id)
    accounted = ledger.inserted + ledger.dropped + ledger.unused
    assert len(set(accounted)) == len(accounted), "a chunk was accounted for twice"
    assert sorted(accounted) == storage.list(f"{layout.prefix}/shards/async")
    for worker in range(workers):
        chunks = sorted(int(key.rsplit("/c", 1)[1][:6]) for key in accounted if f"/w{worker:03d}/" in key)
        assert chunks == list(range(len(chunks))), f"worker {worker}'s chunks: {chunks}"
    assert all(ledger.lags[key] <= max_policy_lag for key in ledger.inserted)
    return ledger
