"""Object storage through fsspec: a local folder by default, s3:// through s3fs.

Workers get a StorageLocation (a URL and options) and open the filesystem themselves; nothing
heavier than that crosses a process boundary.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem


@dataclass(frozen=True)
class StorageLocation:
    root: str
    options: dict[str, Any] = field(default_factory=dict)


class Storage:
    """Keys ('runs/abc/shards/v000001/w000.npz') under one root URL."""

    def __init__(self, location: StorageLocation):
        self.location = location
        self.fs, self.base = fsspec.core.url_to_fs(location.root, **location.options)
        self.base = self.base.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)

    def path(self, key: str) -> str:
        return f"{self.base}/{key}"

    def url(self, key: str = "") -> str:
        return self.fs.unstrip_protocol(self.path(key) if key else self.base)

    def write(self, key: str, data: bytes) -> None:
        """Write a whole object. On a local folder it appears at once (temp file, then rename),
        as an S3 PUT does."""
        path = self.path(key)
        if not self.local:
            self.fs.pipe_file(path, data)
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.tmp-{uuid.uuid4().hex}"
        with open(temporary, "wb") as handle:
            handle.write(data)
        os.replace(temporary, path)

    def read(self, key: str) -> bytes:
        return self.fs.cat_file(self.path(key))

    def exists(self, key: str) -> bool:
        return self.fs.exists(self.path(key))

    def list(self, prefix: str) -> list[str]:
        """Keys of the objects under `prefix`, sorted."""
        root = self.path(prefix)
        if not self.fs.exists(root):
            return []
        found = self.fs.find(root)
        return sorted(path[len(self.base) + 1 :] for path in found if ".tmp-" not in path)

    def download(self, prefix: str, local_dir: str) -> None:
        for key in self.list(prefix):
            target = os.path.join(local_dir, os.path.relpath(key, prefix))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as handle:
                handle.write(self.read(key))


def open_storage(location: StorageLocation) -> Storage:
    """One Storage per location and process."""
    return _open_cached(location.root, json.dumps(location.options, sort_keys=True))


@lru_cache(maxsize=16)
def _open_cached(root: str, options_json: str) -> Storage:
    return Storage(StorageLocation(root, json.loads(options_json)))


@dataclass(frozen=True)
class RunLayout:
    """Where each piece of a run lives, derived from the run id alone."""

    run_id: str

    @property
    def prefix(self) -> str:
        return f"runs/{self.run_id}"

    @property
    def preset(self) -> str:
        return f"{self.prefix}/preset.yaml"

    def shard(self, version: int | None, worker: int) -> str:
        round_name = "heatup" if version is None else f"v{version:06d}"
        return f"{self.prefix}/shards/{round_name}/w{worker:03d}.npz"

    @property
    def checkpoints(self) -> str:
        return f"{self.prefix}/checkpoints"

    def checkpoint(self, version: int) -> str:
        return f"{self.checkpoints}/v{version:06d}"

    @property
    def latest(self) -> str:
        return f"{self.checkpoints}/latest"
