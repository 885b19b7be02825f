"""Object storage through fsspec: a local folder by default, s3:// through s3fs.

Workers get a StorageLocation (a URL and options) and open the filesystem themselves; nothing
heavier than that crosses a process boundary.

On S3, every try again is gymflow's, counted once (`Storage._within_budget`): botocore makes one
attempt a call and s3fs none of its own retries (the two multiplied held one call to a store that
accepts and never answers ~25 minutes). A blip (a dropped connection, a 5xx, throttling) is tried
again at once, unsaid; a call that still gets no answer is tried again after pauses of up to a few
seconds while the store's outage lasts less than `storage.outage_budget_s` (gymflow/outage.py),
each attempt's timeouts a share of that budget; past it, or at once where the store answers that
the bucket is gone, it raises ServerLost. A preset's `storage.options.config_kwargs` overrides
these defaults. Listing caches are off, so a key written by another process is seen.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import itertools
import json
import os
import random
import shutil
import threading
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from gymflow.commands import gymflow_command
from gymflow.errors import ServerLost, StorageFull, StorageRefused
from gymflow.outage import STORE_PAUSE_S, Budget, Outage, store_attempt_timeouts

if TYPE_CHECKING:
    from gymflow.presets.model import StorageConfig

S3_PROTOCOLS = ("s3", "s3a")
S3_DEFAULTS: dict[str, Any] = {
    "use_listings_cache": False,
    "config_kwargs": {
        # one attempt a call: every try again is the outage budget's (`Storage._within_budget`), counted
        # once; botocore's five attempts times s3fs's five retries held one call to a silent store ~25 min
        "retries": {"mode": "standard", "total_max_attempts": 1},
        "connect_timeout": 10,
        "read_timeout": 60,
    },
}


def filesystem_options(root: str, options: dict[str, Any], budget_s: float | None = None) -> dict[str, Any]:
    """The options a filesystem is opened with: the preset's, over gymflow's defaults for S3 (one
    attempt's timeouts within `budget_s`, the outage budget, where given)."""
    if fsspec.utils.get_protocol(root) not in S3_PROTOCOLS:
        return dict(options)
    merged = {**S3_DEFAULTS, **options}
    within = store_attempt_timeouts(budget_s) if budget_s is not None else {}
    merged["config_kwargs"] = {**S3_DEFAULTS["config_kwargs"], **within, **options.get("config_kwargs", {})}
    return merged


def _s3fs_tries_once(fs: Any) -> None:
    """s3fs's own retries (5 by default, around botocore's attempts) off for this file system: a call
    is tried again by the outage budget alone."""
    if not isinstance(fs, LocalFileSystem) and hasattr(type(fs), "retries"):
        fs.retries = 1


OUTAGE_BUDGET_FIELD = "storage.outage_budget_s"
STORE_FIELD = "storage.root"  # what a lost object store's line names
FIRST_PAUSE_S = 0.1  # the first pause; each next one doubles
BLIP_TRIES, BLIP_S = 3, 2.0  # failures within these are tried again unsaid (a blip, not yet an outage)
T = TypeVar("T")


@dataclass(frozen=True)
class StorageLocation:
    root: str
    options: dict[str, Any] = field(default_factory=dict)
    outage_budget_s: float = 300.0  # how long an object store may go unanswered (storage.outage_budget_s)


# what a file system says when it takes no more: full, over quota, read-only
_REFUSED_WRITES = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}


class Storage:
    """Keys ('runs/abc/shards/v000001/w000.npz') under one root URL."""

    def __init__(self, location: StorageLocation):
        self.location = location
        self.fs, self.base = fsspec.core.url_to_fs(location.root, **filesystem_options(
            location.root, location.options, location.outage_budget_s))
        _s3fs_tries_once(self.fs)
        self.base = self.base.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)
        self.reads: Counter[str] = Counter()  # objects read by this process, by kind (`read_kind`)
        self._behind: _WritesBehind | None = None
        self.outage = None if self.local else _store_outage(location)

    def path(self, key: str) -> str:
        return f"{self.base}/{key}"

    def url(self, key: str = "") -> str:
        return self.fs.unstrip_protocol(self.path(key) if key else self.base)

    @contextlib.contextmanager
    def writing_behind(self) -> Iterator[None]:
        """While inside, this process's `write`s to a local folder return at once and are made in
        order on a thread of their own (single mode: a CartPole round's five files cost the loop
        ~2-4 ms on this VM's disk). Every other operation on the storage waits for them first, as
        does a job sent to single mode's helper process (`settle_writes`), so nothing reads what is
        not there yet; in order, a checkpoint never lands before the shards it names. A write
        that failed is raised by the next operation. Leaving waits for them all."""
        if not self.local or self._behind is not None:
            yield
            return
        self._behind = _WritesBehind()
        _writing_behind.add(self)
        try:
            yield
        finally:
            _writing_behind.discard(self)
            behind, self._behind = self._behind, None
            behind.close()

    def settled(self) -> None:
        """Wait for the writes made behind (`writing_behind`) so far; raise one that failed."""
        if (behind := self._behind) is not None:
            behind.settle()

    def write(self, key: str, data: bytes) -> None:
        """Write a whole object. On a local folder it appears at once (temp file, then rename),
        as an S3 PUT does."""
        if (behind := self._behind) is not None:
            behind.put(partial(self._write_now, key, data))
            return
        self._write_now(key, data)

    def _write_now(self, key: str, data: bytes) -> None:
        path = self.path(key)
        if not self.local:
            self._answered(key, lambda: self.fs.pipe_file(path, data))
            return
        with self._refused_writes_said(key):
            _appear_at_once(path, lambda temporary: Path(temporary).write_bytes(data))

    def _answered(self, key: str, call: Callable[[], T]) -> T:
        """`call` to the object store, about `key`; tried again while the store goes unanswered
        within its outage budget. Past it, ServerLost naming the command that continues the run."""
        if self.outage is None:
            return call()
        try:
            return self._within_budget(call, self.outage)
        except ServerLost as lost:
            raise self._lost_said(key, lost) from None

    def _within_budget(self, call: Callable[[], T], outage: Outage) -> T:
        """`call` tried until answered, after pauses that double from FIRST_PAUSE_S up to
        STORE_PAUSE_S (with jitter). A blip (failures answered fast, within BLIP_S of the first: a
        dropped connection, a 503 SlowDown) is tried again unsaid, as botocore's retries did; past
        it the outage is said and counted against the budget from the first failed try."""
        first_failed: float | None = None
        for tries in itertools.count():
            outage.check()
            asked_at = time.monotonic()
            try:
                answer = call()
            except Exception as error:
                if not (unanswered := store_unanswered(error)):
                    raise
                if unanswered == BUCKET_GONE:
                    outage.gone(f"bucket {self.base.split('/')[0]!r} does not exist any more")
                    continue
                first_failed = asked_at if first_failed is None else first_failed
                pause = min(STORE_PAUSE_S, FIRST_PAUSE_S * 2 ** min(tries, 16)) * random.uniform(0.5, 1.0)
                if tries >= BLIP_TRIES or time.monotonic() - first_failed >= BLIP_S:  # raises once the budget is spent
                    pause = min(pause, max(outage.failed(error, first_failed), 0.0))
                time.sleep(pause)
                continue
            outage.answered()
            return answer
        raise AssertionError("unreachable")

    def _lost_said(self, key: str, lost: ServerLost) -> ServerLost:
        parts = key.split("/")
        if len(parts) < 2 or parts[0] != "runs":
            return lost
        resume = f"{gymflow_command()} resume {parts[1]} --root {self.location.root}"
        return ServerLost(lost.field, f"{lost.problem}; what the run committed stays: `{resume}` continues it once the "
                                      "store answers")

    @contextlib.contextmanager
    def _refused_writes_said(self, key: str) -> Iterator[None]:
        """A write the file system refuses (full, over quota, read-only) as one line naming the root,
        what to do, and, for a run's object, the command that continues the run."""
        try:
            yield
        except OSError as error:
            if error.errno not in _REFUSED_WRITES:
                raise
            root, parts = self.location.root, key.split("/")
            resume = f"{gymflow_command()} resume {parts[1]} --root {root}" if len(parts) > 2 else ""
            then = (f", then `{resume}` continues the run from what it committed"
                    if len(parts) > 2 and parts[0] == "runs" else " or set storage.root to another place")
            raise StorageFull("storage.root", f"{root} refused a write: {os.strerror(error.errno)}; free space "
                              f"there{then}") from None

    def upload(self, key: str, local_path: str) -> None:
        """Write a local file as a whole object without holding it in memory (S3: a multipart
        upload where it is large); it appears at once, as `write`'s do."""
        self.settled()
        path = self.path(key)
        if not self.local:
            self._answered(key, lambda: self.fs.put_file(local_path, path))
            return
        with self._refused_writes_said(key):
            _appear_at_once(path, lambda temporary: shutil.copyfile(local_path, temporary))

    def read(self, key: str) -> bytes:
        self.settled()
        self.reads[read_kind(key)] += 1
        return self._answered(key, lambda: self.fs.cat_file(self.path(key)))

    def exists(self, key: str) -> bool:
        self.settled()
        return self._exists(key)

    def _exists(self, key: str) -> bool:
        """A local path is asked of the OS: fsspec's own `exists` catches everything, so a Ctrl-C or
        SIGTERM (KeyboardInterrupt, Prefect's TerminationSignal) arriving inside it turned into
        "no such object" and the stop into a "shard is missing" failure."""
        path = self.path(key)
        if self.local:
            return os.path.exists(path)
        return self._answered(key, lambda: self.fs.exists(path))

    def list(self, prefix: str) -> list[str]:
        """Keys of the objects under `prefix`, sorted."""
        self.settled()
        root = self.path(prefix)
        if not self._exists(prefix):
            return []
        found = self._answered(prefix, lambda: self.fs.find(root))
        return sorted(path[len(self.base) + 1 :] for path in found if ".tmp-" not in path)

    def delete(self, keys: Iterable[str]) -> None:
        """Remove objects (keys already gone are skipped); on a local folder, also the folders
        this leaves empty."""
        self.settled()
        keys = list(keys)
        paths = [self.path(key) for key in keys]
        if not paths:
            return
        if not self.local:
            with contextlib.suppress(FileNotFoundError):
                self._answered(keys[0], lambda: self.fs.rm(paths))
            return
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        for folder in sorted({os.path.dirname(path) for path in paths}, key=len, reverse=True):
            self._remove_empty_folders(folder)

    def _remove_empty_folders(self, folder: str) -> None:
        """`folder` and its parents, up to the root, while they are empty."""
        while folder.startswith(self.base + "/"):
            try:
                os.rmdir(folder)
            except OSError:  # not empty, or already gone
                return
            folder = os.path.dirname(folder)

    def download(self, prefix: str, local_dir: str) -> None:
        for key in self.list(prefix):
            target = os.path.join(local_dir, os.path.relpath(key, prefix))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as handle:
                handle.write(self.read(key))


_writing_behind: weakref.WeakSet[Storage] = weakref.WeakSet()


def settle_writes() -> None:
    """Wait for every write this process makes behind (`Storage.writing_behind`): before another
    process is asked to read what they wrote."""
    for storage in list(_writing_behind):
        storage.settled()


class _WritesBehind:
    """Writes made in order on one thread; `settle` waits for those put so far."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="storage-writes")
        self._lock = threading.Lock()
        self._pending: list[Future[None]] = []

    def put(self, write: Callable[[], None]) -> None:
        with self._lock:
            self._raise_failed()
            self._pending.append(self._thread.submit(write))

    def settle(self) -> None:
        with self._lock:
            pending = list(self._pending)
        concurrent.futures.wait(pending)
        with self._lock:
            self._raise_failed()

    def close(self) -> None:
        try:
            self.settle()
        finally:
            self._thread.shutdown()

    def _raise_failed(self) -> None:
        done = [future for future in self._pending if future.done()]
        self._pending = [future for future in self._pending if not future.done()]
        for future in done:
            future.result()


def _appear_at_once(path: str, fill: Callable[[str], object]) -> None:
    """A local file written whole to a temporary name by `fill`, then renamed to `path`."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        fill(temporary)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)  # nothing half-written stays
        raise


def read_kind(key: str) -> str:
    """What a read fetched, for counting: `policies/policy.safetensors`, `shards`, `run.json`, ..."""
    parts = key.split("/")
    if len(parts) <= 2:
        return parts[-1]
    return f"{parts[2]}/{parts[-1]}" if parts[2] in ("policies", "checkpoints") else parts[2]


BUCKET_GONE = "bucket gone"


def store_unanswered(error: BaseException) -> bool | str:
    """Whether `error` is the object store not answering (no connection, a timeout, a 5xx), or
    BUCKET_GONE where it answered that the bucket is not there (a store restarted without its data);
    False for any other answer (a missing key, a refused login)."""
    from botocore.exceptions import ClientError, HTTPClientError
    from botocore.exceptions import ConnectionError as NoConnection

    seen: BaseException | None = error
    while seen is not None:  # s3fs raises an OSError made from botocore's error, which is its cause
        if isinstance(seen, (NoConnection, HTTPClientError, TimeoutError, ConnectionError)):
            return True
        if isinstance(seen, ClientError):
            if seen.response.get("Error", {}).get("Code") == "NoSuchBucket":
                return BUCKET_GONE
            return seen.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) >= 500
        seen = seen.__cause__ or seen.__context__
    return False


def _store_outage(location: StorageLocation) -> Outage:
    endpoint = location.options.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3"
    budget = Budget(location.outage_budget_s, OUTAGE_BUDGET_FIELD, "what the run reads and writes there waits")
    return Outage(f"the object store at {endpoint}", budget, STORE_FIELD)


def storage_location(config: StorageConfig) -> StorageLocation:
    """Where a preset's `storage` section points; a relative local folder as an absolute path,
    which a worker in another working folder (or on another machine, sharing it) finds too."""
    root = config.root
    if fsspec.utils.get_protocol(root) == "file" and "://" not in root:
        root = os.path.abspath(root)
    return StorageLocation(root, dict(config.options), config.outage_budget_s)


def open_storage(location: StorageLocation) -> Storage:
    """One Storage per location and process."""
    return _open_cached(location.root, json.dumps(location.options, sort_keys=True), location.outage_budget_s)


@lru_cache(maxsize=16)
def _open_cached(root: str, options_json: str, outage_budget_s: float) -> Storage:
    return Storage(StorageLocation(root, json.loads(options_json), outage_budget_s))


def check_storage(location: StorageLocation) -> None:
    """Refuse, with one line and before anything is written, a root that cannot be used: a
    missing bucket, refused credentials, an unreachable endpoint, a local path that is a file."""
    if fsspec.utils.get_protocol(location.root) in S3_PROTOCOLS:
        _check_bucket(location)
    elif fsspec.utils.get_protocol(location.root) == "file":
        _check_local_folder(fsspec.core.url_to_fs(location.root)[1])


def ready_storage(location: StorageLocation) -> Storage:
    """The run's storage, checked (`check_storage`); a local root is created (an empty folder),
    so that a worker sharing it can tell it sees the same folder (`check_shared_root`)."""
    check_storage(location)
    storage = open_storage(location)
    if storage.local:
        os.makedirs(storage.base, exist_ok=True)
    return storage


def check_shared_root(location: StorageLocation) -> None:
    """From a worker: the root the flow made ready is reachable here too: a bucket with this
    machine's credentials, a local folder at the flow's path (a shared mount)."""
    storage = open_storage(location)
    if not storage.local:
        check_storage(location)
    elif not os.path.isdir(storage.base):
        raise StorageRefused("storage.root", f"there is no folder {storage.base!r} there: a local root must be "
                                             "mounted at the same path on every worker")


def _check_bucket(location: StorageLocation) -> None:
    from botocore.exceptions import BotoCoreError

    options = filesystem_options(location.root, location.options)
    # A quick probe: two attempts, short timeouts (s3fs's retries off), so an unreachable or silent
    # endpoint is refused within ~25 s.
    options["config_kwargs"] = {**options["config_kwargs"], "connect_timeout": 5, "read_timeout": 10,
                                "retries": {"mode": "standard", "total_max_attempts": 2}}
    fs, path = fsspec.core.url_to_fs(location.root, skip_instance_cache=True, **options)
    _s3fs_tries_once(fs)
    bucket = path.split("/")[0]
    endpoint = location.options.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3"
    try:
        fs.call_s3("list_objects_v2", Bucket=bucket, MaxKeys=1)
    except FileNotFoundError:
        raise StorageRefused("storage.root", f"bucket {bucket!r} does not exist at {endpoint}") from None
    except PermissionError as error:
        raise StorageRefused(
            "storage.options",
            f"{endpoint} refused the credentials for bucket {bucket!r} ({error}); set storage.options "
            "key/secret or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY",
        ) from None
    except (OSError, BotoCoreError) as error:
        raise StorageRefused("storage.options.endpoint_url", f"cannot reach {endpoint}: {error}") from None


def _check_local_folder(path: str) -> None:
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise StorageRefused("storage.root", f"{existing!r} is a file, not a folder")
    if not os.access(existing, os.W_OK):
        raise StorageRefused("storage.root", f"{existing!r} is not writable")
