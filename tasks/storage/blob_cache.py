"""A folder of verified blobs named by their sha256, shared by the worker processes of one machine.

Every worker process of a round loads the same policy version. Each keeps what it loaded
(tasks/cluster/jobs.py), so storage sees one read a process; with many worker processes on one
node (`dask worker --nworkers 16`) that is still one read of the same blob per process. Here the
first process of a node to need a blob reads it from storage, checks it against its manifest,
and leaves it in this folder; the others wait for it (a file lock per blob) and read it from
disk. Only a blob whose sha256 was checked is written, under that name, and a cached file is
checked again when read, so a damaged file is read from storage again, never used.

Where: `$GYMFLOW_BLOB_CACHE` (`off`: no cache, every process reads from storage), else a folder of
the user's in the system's temporary folder. The newest `KEEP` blobs are kept (pruned past twice that).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

KEEP = 256


class BlobCache:
    def __init__(self, folder: Path):
        self.folder = folder

    @classmethod
    def for_this_machine(cls) -> BlobCache | None:
        folder = os.environ.get("GYMFLOW_BLOB_CACHE") or os.path.join(tempfile.gettempdir(),
                                                                      f"gymflow-blobs-{os.getuid()}")
        return None if folder == "off" else cls(Path(folder))

    def get_or_fetch(self, sha256: str, fetch: Callable[[], bytes]) -> bytes:
        """The blob named `sha256`: from this folder, or from `fetch()` (which checks it) and kept.
        The folder only saves reads: where it cannot be used, the blob is fetched."""
        cached = self._read(sha256)
        if cached is not None:
            return cached
        try:
            with self._locked(sha256):
                cached = self._read(sha256)  # another process fetched it while this one waited
                if cached is not None:
                    return cached
                data = fetch()
                if hashlib.sha256(data).hexdigest() == sha256:
                    self._keep(sha256, data)
                return data
        except OSError:  # no folder to lock in (read-only, full)
            return fetch()

    def _read(self, sha256: str) -> bytes | None:
        try:
            data = (self.folder / sha256).read_bytes()
        except OSError:
            return None
        return data if hashlib.sha256(data).hexdigest() == sha256 else None

    def _keep(self, sha256: str, data: bytes) -> None:
        try:
            temporary = self.folder / f".{sha256}.{uuid.uuid4().hex}"
            temporary.write_bytes(data)
            os.replace(temporary, self.folder / sha256)
            self._prune()
        except OSError:  # a full disk, another process pruning at once: the cache is only slower
            pass

    def _prune(self) -> None:
        """Past 2 x KEEP blobs, back to the newest KEEP: deleting is rare, and a blob another process
        deleted first is passed over."""
        blobs = []
        for path in self.folder.iterdir():
            if len(path.name) == 64:
                try:
                    blobs.append((path.stat().st_mtime, path))
                except OSError:  # pruned by another process meanwhile
                    continue
        if len(blobs) <= 2 * KEEP:
            return
        for _, path in sorted(blobs)[:-KEEP]:
            for stale in (path, self.folder / f"{path.name}.lock"):
                stale.unlink(missing_ok=True)

    @contextmanager
    def _locked(self, sha256: str) -> Iterator[None]:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"{sha256}.lock", "a") as lock:
            try:
                import fcntl
            except ImportError:  # no POSIX locks (Windows): processes may fetch the same blob at once
                yield
                return
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
