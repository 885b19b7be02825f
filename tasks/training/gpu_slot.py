"""A learner on a GPU holds one of that GPU's slots for as long as it trains, so two runs (two
deployments, a run and a sweep) never share one GPU unknowingly: the second waits, saying who holds
it, until the first lets go, or until `distribution.gpu_wait_s` has passed, then stops in one line.

A GPU's slots are its Prefect global concurrency limit `gpu-HOST-N` (made with one slot the first
time it is asked for; an administrator may give it more, e.g. for MIG slices: `prefect gcl update
gpu-HOST-0 --limit 2`), which the Prefect UI shows, and one lock file per slot on the host
(`SLOTS_FOLDER`), which the operating system lets go of when its holder dies however it dies
(SIGKILL, the OOM killer). A lease in Prefect does not: the command's temporary Prefect API keeps
its leases in memory and dies with the run, leaving the limit's count taken for good. So the lock is
what decides; the limit follows it, and a count that no live holder's lock backs is given back.
For the same reason a lease the server loses (a restart: Prefect keeps leases in memory; an outage
longer than its renewals' retries) never stops training: it is said in one line, and Prefect's own
renewal errors are kept off the terminal.

The folder is shared by every user of the host, so nobody may turn it against another: it is used
only as a real folder (not a link) that belongs to root or to this user and is sticky (nobody
removes or renames another's files), and every file in it is opened with O_NOFOLLOW, so a link
planted in a slot's name is refused instead of followed."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import pwd
import re
import socket
import stat
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from gymflow.errors import ClusterUnavailable
from gymflow.logs import AnyLogger

FIRST_TRY_SECONDS = 2.0  # a free slot is taken within this; past it, the run says it waits
POLL_SECONDS = 2.0  # how often a waiting run tries the slots again
LEASE_SECONDS = 300.0  # the limit's lease, renewed by Prefect's thread every 3/4 of it
# where Prefect's lease renewal logs (its own logger, or the run's logger when inside a run)
RENEWAL_LOGGERS = ("prefect.concurrency", "prefect.flow_runs", "prefect.task_runs")
RENEWAL_THREAD = "concurrency-lease-renewal-"  # Prefect's renewal thread's name starts so
RENEWAL_GAVE_UP = "Concurrency lease renewal failed"  # its last record, once its retries are spent
SLOTS_FOLDER = Path(tempfile.gettempdir()) / "gymflow-gpu-slots"  # every user's runs on this host meet here
SHARED_MODE = 0o644  # a slot's files: every user opens the lock to lock it and reads who holds it


def slot_name(device: str, host: str | None = None) -> str | None:
    """`gpu-HOST-N` for a CUDA device (`cuda`, `cuda:N`); None for any other."""
    if not device.startswith("cuda"):
        return None
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    host = re.sub(r"[^A-Za-z0-9-]+", "-", host or socket.gethostname()).strip("-") or "host"
    return f"gpu-{host}-{index}"


@dataclass(frozen=True)
class SlotHolder:
    """Who holds a slot, as its lock file says."""

    run: str
    pid: int
    since: float  # time.time() when it took the slot

    def describe(self) -> str:
        return f"run {self.run or '(unnamed)'} (pid {self.pid}, for {time.time() - self.since:.0f} s)"


@contextmanager
def gpu_slot(device: str, logger: AnyLogger, host: str | None = None, run: str = "",
             wait_s: float = 3600.0) -> Iterator[str | None]:
    """Hold a slot of `device` (nothing for a CPU) while inside; yields its name. Raises
    `ClusterUnavailable` naming the holders if none comes free within `wait_s`."""
    name = slot_name(device, host)
    if name is None:
        yield None
        return
    limit = _limit(name)
    with ExitStack() as stack:
        stack.enter_context(_slot_lock(name, limit, logger, run, wait_s))
        _occupy_limit(stack, name, limit, logger)
        yield name


@contextmanager
def gpu_slots(devices: Sequence[str], logger: AnyLogger, run: str = "", wait_s: float = 3600.0
              ) -> Iterator[list[str]]:
    """A slot of each of the learning ranks' `devices` (distribution.learners), held while inside;
    yields the names of the GPUs' (none for CPUs)."""
    with ExitStack() as stack:
        names = [stack.enter_context(gpu_slot(device, logger, run=run, wait_s=wait_s))
                 for device in dict.fromkeys(devices)]
        yield [name for name in names if name is not None]


@contextmanager
def _slot_lock(name: str, limit: int, logger: AnyLogger, run: str, wait_s: float) -> Iterator[None]:
    """One of the limit's lock files, held (and naming this run) while inside."""
    _shared_folder_checked()
    deadline, said = time.monotonic() + wait_s, False
    while True:
        held = _try_lock(name, limit, run)
        if held is not None:
            break
        holders = _holders(name, limit)
        if time.monotonic() >= deadline:
            raise ClusterUnavailable("distribution.gpu_wait_s", f"{name} was still held after {wait_s:g} s, by "
                                     f"{_described(holders)}; allowed: a longer wait, or another "
                                     f"distribution.learner_device")
        if not said:
            logger.warning("waiting for %s: %s trains on this GPU (up to distribution.gpu_wait_s, %g s)", name,
                           _described(holders), wait_s)
            said = True
        time.sleep(min(POLL_SECONDS, max(0.0, deadline - time.monotonic())))
    descriptor, holder_file = held
    if said:
        logger.info("%s is this run's now", name)
    try:
        yield
    finally:
        with suppress(OSError):
            holder_file.unlink()
        os.close(descriptor)  # the lock goes with it


def _try_lock(name: str, limit: int, run: str) -> tuple[int, Path] | None:
    """The first free slot's lock file, locked (its descriptor), and the file naming its holder. A lock
    file another user made that this user may not open (an older gymflow's, under umask 077) counts
    as held: `_unopenable` names it while the run waits."""
    for index in range(limit):
        path = _lock_file(name, index)
        # read-only: another user's lock file locks as well; no child process inherits it
        try:
            descriptor = _open_unlinked(path, os.O_RDONLY | os.O_CREAT, SHARED_MODE)
        except PermissionError:
            continue
        except OSError as error:
            if error.errno != errno.ELOOP:
                raise
            raise ClusterUnavailable("distribution.learner_device", f"{path} is a link, which this run does not "
                                     "follow; allowed: remove it") from None
        _shared(descriptor)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            continue
        holder_file = path.with_suffix(".holder")
        with suppress(OSError):
            holder = _open_unlinked(holder_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, SHARED_MODE)
            _shared(holder)
            with os.fdopen(holder, "w") as out:
                out.write(json.dumps({"run": run, "pid": os.getpid(), "since": time.time()}))
        return descriptor, holder_file
    return None


def _lock_file(name: str, index: int) -> Path:
    return SLOTS_FOLDER / f"{name}.{index}.lock"


def _shared(descriptor: int) -> None:
    """A file this user made in the shared folder given SHARED_MODE whatever the umask made it (0600
    under 077 would lock every other user out of the slot)."""
    with suppress(OSError):
        if os.fstat(descriptor).st_uid == os.geteuid():
            os.fchmod(descriptor, SHARED_MODE)


def _unopenable(name: str, limit: int) -> list[str]:
    """The slots' lock files this user may not open, each with its owner."""
    found = []
    for index in range(limit):
        path = _lock_file(name, index)
        with suppress(OSError):
            if not os.access(path, os.R_OK, follow_symlinks=False):
                found.append(f"{path} ({_user(path.lstat().st_uid)}'s, mode "
                             f"{path.lstat().st_mode & 0o777:03o}: held by their run, or left by one)")
    return found


def _holders(name: str, limit: int) -> list[SlotHolder | str]:
    holders: list[SlotHolder | str] = []
    for index in range(limit):
        with suppress(OSError, ValueError, TypeError, KeyError):
            with os.fdopen(_open_unlinked(SLOTS_FOLDER / f"{name}.{index}.holder", os.O_RDONLY)) as holder:
                holders.append(SlotHolder(**json.loads(holder.read(4096))))
    return [*holders, *_unopenable(name, limit)]


def _open_unlinked(path: Path, flags: int, mode: int = 0o600) -> int:
    """`path` opened only if it is not a symbolic link (OSError ELOOP where it is one)."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def _shared_folder_checked() -> None:
    """SLOTS_FOLDER made (sticky and open to every user, whose runs share the GPU too) where it is not
    there; refused in one line where it is a link, or belongs to another user, or lets anyone
    remove its files."""
    with suppress(FileExistsError):
        SLOTS_FOLDER.mkdir()
        with suppress(PermissionError):
            SLOTS_FOLDER.chmod(0o1777)
    found = SLOTS_FOLDER.lstat()
    sticky = bool(found.st_mode & stat.S_ISVTX) or not found.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if stat.S_ISDIR(found.st_mode) and found.st_uid in (0, os.geteuid()) and sticky:
        return
    what = "a link" if stat.S_ISLNK(found.st_mode) else "not a folder" if not stat.S_ISDIR(found.st_mode) else \
        f"owned by {_user(found.st_uid)}" if found.st_uid not in (0, os.geteuid()) else "writable by others, not sticky"
    raise ClusterUnavailable("distribution.learner_device", f"{SLOTS_FOLDER} ({what}) could be turned against this "
                             f"run; allowed: remove it, or have root make it with `install -d -m 1777 {SLOTS_FOLDER}`")


def _user(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return f"uid {uid}"


def _described(holders: list[SlotHolder | str]) -> str:
    return ", ".join(holder if isinstance(holder, str) else holder.describe() for holder in holders) or "another run"


def _occupy_limit(stack: ExitStack, name: str, limit: int, logger: AnyLogger) -> None:
    """Take a slot of the Prefect limit too (what the UI shows). With a lock held, a limit that is
    full counts a holder that died without letting go: its count is given back, once per slot."""
    for _ in range(limit + 1):
        try:
            stack.enter_context(_counted_in_limit(name, logger))
            return
        except TimeoutError:
            logger.warning("%s: a run that held it ended without letting go; its slot is given back", name)
            with get_client(sync_client=True) as client:
                client.release_concurrency_slots(names=[name], slots=1, occupancy_seconds=0.001)  # must be > 0
    raise ClusterUnavailable("distribution.learner_device", f"the Prefect limit {name} stays full though no run "
                             f"holds it; allowed: `prefect gcl update {name} --active-slots 0` first")


@contextmanager
def _counted_in_limit(name: str, logger: AnyLogger) -> Iterator[None]:
    """One of the limit's slots while inside (TimeoutError if none is free). A lease the server loses
    and a count that cannot be given back at the end are each one line; neither stops training."""
    said = _LeaseLostSaid(name, logger)
    for renewal_logger in RENEWAL_LOGGERS:
        logging.getLogger(renewal_logger).addFilter(said)
    try:
        lease = ExitStack()
        lease.enter_context(concurrency(name, occupy=1, timeout_seconds=FIRST_TRY_SECONDS, strict=True,
                                        lease_duration=LEASE_SECONDS, raise_on_lease_renewal_failure=False))
        try:
            yield
        finally:
            try:
                lease.close()
            except Exception as error:  # the server out of reach at the end: the next run that takes it puts it right
                logger.warning("%s: its count in Prefect could not be given back (%s); the next run that takes "
                               "this GPU gives it back", name, f"{type(error).__name__}: {error}".splitlines()[0])
    finally:
        for renewal_logger in RENEWAL_LOGGERS:
            logging.getLogger(renewal_logger).removeFilter(said)


class _LeaseLostSaid(logging.Filter):
    """Prefect's lease renewal's records (a warning per failed try, a traceback, a last warning),
    kept off the terminal; in their place one line, the first time."""

    def __init__(self, name: str, logger: AnyLogger) -> None:
        super().__init__()
        self.slot, self.logger, self.said = name, logger, False

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.threadName or not record.threadName.startswith(RENEWAL_THREAD):
            return True
        if not self.said and record.getMessage().startswith(RENEWAL_GAVE_UP):
            self.said = True
            self.logger.warning("%s: the Prefect server no longer answers for this run's lease on it (restarted, "
                                "or out of reach); training goes on, the GPU still this run's by its lock file",
                                self.slot)
        return False


def _limit(name: str) -> int:
    """The limit's slots, making it with one the first time; raises if an administrator set none."""
    with get_client(sync_client=True) as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(name).limit
        except ObjectNotFound:
            with suppress(ObjectAlreadyExists):  # another run made it in the same instant
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
            limit = client.read_global_concurrency_limit_by_name(name).limit
    if limit < 1:
        raise ClusterUnavailable("distribution.learner_device", f"the Prefect limit {name} has {limit} slots, so no "
                                 f"run may train on that GPU; allowed: `prefect gcl update {name} --limit 1`")
    return limit
