"""Versioned, atomically committed folders of blobs that load without executing code: a run's
published policies (what rollout workers act with, one per committed version) and its
checkpoints (what a resume needs, on the preset's cadence).

Commit protocol: write every blob, then `manifest.json` with each blob's size and sha256, then
move the shelf's `latest` pointer. A reader loads a version only through its manifest and checks
every hash, so a half-written or tampered version is refused, never loaded. Retiring a version
deletes its manifest first, so a half-deleted version reads as never committed.

Blobs are bytes encoded by tasks/storage/codec.py: safetensors, JSON and npz, never pickle.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from typing import Any

from gymflow.tasks.storage.blob_cache import BlobCache
from gymflow.tasks.storage.layout import RunLayout, Shelf
from gymflow.tasks.storage.objects import Storage

MANIFEST = "manifest.json"
POLICY_BLOB = "policy.safetensors"  # what a rollout worker loads to act
LEARNER_TENSORS, LEARNER_TREE = "learner.safetensors", "learner.json"  # the learner's state (codec.encode_state)
REPLAY_BLOB = "replay.npz"  # the replay memory, where storage.checkpoint_replay asks for it
REPLAY_POSITION = "replay_position.json"  # else where the memory stood, to rebuild it from shards
SHARD_FLOOR = "shard_floor.json"  # the oldest shards a resume from the checkpoint reads


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or does not match its manifest."""


@dataclass(frozen=True)
class CheckpointRef:
    run_id: str
    version: int


def commit_checkpoint(storage: Storage, layout: RunLayout, version: int, blobs: dict[str, bytes]) -> CheckpointRef:
    commit_version(storage, layout.checkpoint_shelf, version, blobs)
    return CheckpointRef(layout.run_id, version)


# where a run's rollouts act in the process that publishes its policies (single mode): the newest
# published versions, by their folder's URL, so that a rollout takes the bytes the learner just wrote
_kept_policies: ContextVar[OrderedDict[str, dict[str, bytes]] | None] = ContextVar("gymflow_kept_policies",
                                                                                    default=None)
KEPT_POLICIES = 2


@contextmanager
def policies_kept_in_process() -> Iterator[None]:
    """While inside, the policies published here stay in this process's memory (the newest
    `KEPT_POLICIES`, which a run's policy window, the newest and at least one before it, keeps
    published) and `read_policy` here takes them from there: written to storage all the same, but
    not read back, checked and cached by the process that wrote them."""
    token = _kept_policies.set(OrderedDict())
    try:
        yield
    finally:
        _kept_policies.reset(token)


def publish_policy(storage: Storage, layout: RunLayout, version: int, blobs: dict[str, bytes]) -> None:
    commit_version(storage, layout.policies, version, blobs)
    if (kept := _kept_policies.get()) is not None:
        kept[storage.url(layout.policies.folder(version))] = blobs
        while len(kept) > KEPT_POLICIES:
            kept.popitem(last=False)


def commit_version(storage: Storage, shelf: Shelf, version: int, blobs: dict[str, bytes]) -> None:
    prefix = shelf.folder(version)
    for name, data in blobs.items():
        storage.write(f"{prefix}/{name}", data)
    manifest = {
        "version": version,
        "created_at": time.time(),
        "blobs": {name: {"size": len(data), "sha256": _sha256(data)} for name, data in blobs.items()},
    }
    storage.write(f"{prefix}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
    storage.write(shelf.latest, json.dumps({"version": version}).encode())


def retire_version(storage: Storage, shelf: Shelf, version: int) -> None:
    """Delete a version: its manifest first, so that no reader loads what is left of it."""
    folder = shelf.folder(version)
    storage.delete([f"{folder}/{MANIFEST}"])
    storage.delete(storage.list(folder))


def latest_version(storage: Storage, layout: RunLayout) -> int:
    """The newest checkpoint's version."""
    return latest_on(storage, layout.checkpoint_shelf)


def latest_policy_version(storage: Storage, layout: RunLayout) -> int:
    """The newest published policy's version."""
    return latest_on(storage, layout.policies)


def latest_on(storage: Storage, shelf: Shelf) -> int:
    if not storage.exists(shelf.latest):
        raise CheckpointError(f"no version has been committed: {storage.url(shelf.latest)} is missing")
    try:
        return int(json.loads(storage.read(shelf.latest))["version"])
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"unreadable pointer {storage.url(shelf.latest)}: {error}") from None


def read_manifest(storage: Storage, shelf: Shelf, version: int) -> dict[str, Any]:
    key = f"{shelf.folder(version)}/{MANIFEST}"
    try:
        manifest = json.loads(storage.read(key))
        manifest["blobs"]
    except FileNotFoundError:
        raise CheckpointError(f"v{version} has no manifest ({storage.url(key)}); it was never committed or is retired"
                              ) from None
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"v{version} has an unreadable manifest: {error}") from None
    return manifest


def read_checkpoint(
    storage: Storage, layout: RunLayout, version: int, names: Iterable[str] | None = None
) -> dict[str, bytes]:
    """The named blobs (all by default) of a checkpoint, each checked against its manifest."""
    return read_version(storage, layout.checkpoint_shelf, version, names)


def read_policy(storage: Storage, layout: RunLayout, version: int, names: Iterable[str] | None = None,
                cache: BlobCache | None = None) -> dict[str, bytes]:
    """The named blobs (all by default) of a published policy version, checked against its
    manifest; through `cache` (a worker machine's, by sha256) where given; from memory where this
    process published it (`policies_kept_in_process`)."""
    names = None if names is None else list(names)
    kept = (_kept_policies.get() or {}).get(storage.url(layout.policies.folder(version)))
    if kept is not None and (names is None or all(name in kept for name in names)):
        return dict(kept) if names is None else {name: kept[name] for name in names}
    return read_version(storage, layout.policies, version, names, cache)


def read_version(storage: Storage, shelf: Shelf, version: int, names: Iterable[str] | None = None,
                 cache: BlobCache | None = None) -> dict[str, bytes]:
    blobs = read_manifest(storage, shelf, version)["blobs"]
    wanted = list(blobs) if names is None else list(names)
    loaded = {}
    for name in wanted:
        if name not in blobs:
            raise CheckpointError(f"{shelf.prefix}/v{version} has no blob {name!r}")
        fetch = partial(_read_blob, storage, shelf, version, name, blobs[name])
        loaded[name] = cache.get_or_fetch(blobs[name]["sha256"], fetch) if cache else fetch()
    return loaded


def _read_blob(storage: Storage, shelf: Shelf, version: int, name: str, expected: dict[str, Any]) -> bytes:
    try:
        data = storage.read(f"{shelf.folder(version)}/{name}")
    except FileNotFoundError:
        raise CheckpointError(f"{shelf.prefix}/v{version}: blob {name!r} is missing") from None
    if len(data) != expected["size"] or _sha256(data) != expected["sha256"]:
        raise CheckpointError(
            f"{shelf.prefix}/v{version}: blob {name!r} does not match its manifest "
            f"({len(data)} bytes, expected {expected['size']}); refusing to load it"
        )
    return data


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class LoadedCheckpoint:
    version: int
    blobs: dict[str, bytes]
    refused: tuple[str, ...]  # why each newer version was not loaded


def committed_versions(storage: Storage, layout: RunLayout) -> list[int]:
    """Versions that have a folder under checkpoints/, committed or not, oldest first."""
    return versions_on(storage, layout.checkpoint_shelf)


def versions_on(storage: Storage, shelf: Shelf) -> list[int]:
    """Versions that have a folder on the shelf, committed or not, oldest first."""
    versions = set()
    for key in storage.list(shelf.prefix):
        folder = key[len(shelf.prefix) + 1 :].split("/")[0]
        if folder.startswith("v") and folder[1:].isdigit():
            versions.add(int(folder[1:]))
    return sorted(versions)


def read_newest_valid_checkpoint(
    storage: Storage, layout: RunLayout, names: Iterable[str] | None = None
) -> LoadedCheckpoint:
    """The version `latest` points to, or, where it cannot be loaded (pointer missing, manifest
    missing, a blob that does not match), the newest earlier version that can. Never a version
    that fails its manifest. Checkpoints are kept on a cadence, so the earlier ones are the
    folders on the shelf."""
    refused: list[str] = []
    stored = sorted(committed_versions(storage, layout), reverse=True)
    try:
        latest = latest_version(storage, layout)
        candidates = [latest, *(version for version in stored if version < latest)]
    except CheckpointError as error:
        refused.append(str(error))
        candidates = stored
    for version in candidates:
        try:
            return LoadedCheckpoint(version, read_checkpoint(storage, layout, version, names), tuple(refused))
        except CheckpointError as error:
            refused.append(str(error))
    raise CheckpointError(f"no loadable checkpoint under {storage.url(layout.checkpoints)}: " + "; ".join(refused))
