"""Versioned, atomically committed checkpoints that load without executing code.

Commit protocol: write every blob, then `manifest.json` with each blob's size and sha256, then
move the `latest` pointer. A reader loads a version only through its manifest and checks every
hash, so a half-written or tampered checkpoint is refused, never loaded.

Blobs are bytes encoded by tasks/storage/codec.py: safetensors, JSON and npz, never pickle.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage

MANIFEST = "manifest.json"
POLICY_BLOB = "policy.safetensors"  # what a rollout worker loads to act
LEARNER_TENSORS, LEARNER_TREE = "learner.safetensors", "learner.json"  # the learner's state (codec.encode_state)
REPLAY_BLOB = "replay.npz"  # the replay memory, where storage.checkpoint_replay asks for it


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or does not match its manifest."""


@dataclass(frozen=True)
class CheckpointRef:
    run_id: str
    version: int


def commit_checkpoint(storage: Storage, layout: RunLayout, version: int, blobs: dict[str, bytes]) -> CheckpointRef:
    prefix = layout.checkpoint(version)
    for name, data in blobs.items():
        storage.write(f"{prefix}/{name}", data)
    manifest = {
        "version": version,
        "created_at": time.time(),
        "blobs": {name: {"size": len(data), "sha256": _sha256(data)} for name, data in blobs.items()},
    }
    storage.write(f"{prefix}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
    storage.write(layout.latest, json.dumps({"version": version}).encode())
    return CheckpointRef(layout.run_id, version)


def latest_version(storage: Storage, layout: RunLayout) -> int:
    if not storage.exists(layout.latest):
        raise CheckpointError(f"no checkpoint has been committed: {storage.url(layout.latest)} is missing")
    try:
        return int(json.loads(storage.read(layout.latest))["version"])
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"unreadable pointer {storage.url(layout.latest)}: {error}") from None


def read_manifest(storage: Storage, layout: RunLayout, version: int) -> dict[str, Any]:
    key = f"{layout.checkpoint(version)}/{MANIFEST}"
    if not storage.exists(key):
        raise CheckpointError(f"checkpoint v{version} has no manifest ({storage.url(key)}); it was never committed")
    try:
        manifest = json.loads(storage.read(key))
        manifest["blobs"]
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"checkpoint v{version} has an unreadable manifest: {error}") from None
    return manifest


def read_checkpoint(
    storage: Storage, layout: RunLayout, version: int, names: Iterable[str] | None = None
) -> dict[str, bytes]:
    """The named blobs (all by default) of a committed version, each checked against its manifest."""
    blobs = read_manifest(storage, layout, version)["blobs"]
    wanted = list(blobs) if names is None else list(names)
    loaded = {}
    for name in wanted:
        if name not in blobs:
            raise CheckpointError(f"checkpoint v{version} has no blob {name!r}")
        key = f"{layout.checkpoint(version)}/{name}"
        if not storage.exists(key):
            raise CheckpointError(f"checkpoint v{version}: blob {name!r} is missing")
        data = storage.read(key)
        expected = blobs[name]
        if len(data) != expected["size"] or _sha256(data) != expected["sha256"]:
            raise CheckpointError(
                f"checkpoint v{version}: blob {name!r} does not match its manifest "
                f"({len(data)} bytes, expected {expected['size']}); refusing to load it"
            )
        loaded[name] = data
    return loaded


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class LoadedCheckpoint:
    version: int
    blobs: dict[str, bytes]
    refused: tuple[str, ...]  # why each newer version was not loaded


def committed_versions(storage: Storage, layout: RunLayout) -> list[int]:
    """Versions that have a folder under checkpoints/, committed or not, oldest first."""
    versions = set()
    for key in storage.list(layout.checkpoints):
        folder = key[len(layout.checkpoints) + 1 :].split("/")[0]
        if folder.startswith("v") and folder[1:].isdigit():
            versions.add(int(folder[1:]))
    return sorted(versions)


def read_newest_valid_checkpoint(
    storage: Storage, layout: RunLayout, names: Iterable[str] | None = None
) -> LoadedCheckpoint:
    """The version `latest` points to, or, where it cannot be loaded (pointer missing, manifest
    missing, a blob that does not match), the newest earlier version that can. Never a version
    that fails its manifest."""
    refused: list[str] = []
    try:
        candidates = list(range(latest_version(storage, layout), -1, -1))
    except CheckpointError as error:
        refused.append(str(error))
        candidates = sorted(committed_versions(storage, layout), reverse=True)
    for version in candidates:
        try:
            return LoadedCheckpoint(version, read_checkpoint(storage, layout, version, names), tuple(refused))
        except CheckpointError as error:
            refused.append(str(error))
    raise CheckpointError(f"no loadable checkpoint under {storage.url(layout.checkpoints)}: " + "; ".join(refused))
