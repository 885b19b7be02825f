"""Job hosts: one Dask actor per worker process, through which rollout and evaluation jobs run.

A Dask task's round trip (client -> scheduler -> worker -> scheduler -> client, then a gather)
costs 10-15 ms on this machine whatever the task does; a call on an actor goes to the worker
and back in about 1.5 ms (benchmarks/round_profile.py). A SYNC round of CartPole collection is
20-40 ms of stepping, so the task round trip alone was a third of it. The jobs and their
per-process caches (tasks/cluster/jobs.py: live envs, loaded policies) are unchanged: a host is only a
door into the worker process.

What Dask did for tasks, `HostPool` does for calls: it picks the worker (job i prefers worker i
among those offering the rollout resources, so a worker finds its live envs again), tells a
worker that died (`HostLost`: the call is redone elsewhere) from a job that failed (a one-line
`JobFailed` naming the job, its worker and the cause is raised at once), and restarts the
worker of a call that outlives its deadline. Jobs run on the host's own threads, as many at
once as the worker has threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import math
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import InvalidStateError, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from logging import Logger, LoggerAdapter
from typing import TYPE_CHECKING, Any, Protocol

import cloudpickle

from gymflow.errors import JobFailed
from gymflow.tasks.cluster.wire import JobFailure, describe_job, one_line_cause, run_job, settle_reply
from gymflow.tasks.storage.shards import shards_kept_in_process

if TYPE_CHECKING:  # Dask is imported by the runs that use it (tasks/cluster/placement.py)
    from distributed import Client, Future

    from gymflow.tasks.cluster.scheduler_link import SchedulerLink

ATTEMPTS = 3  # a job is tried this many times (worker deaths and deadlines together) before the run fails;
# a worker that closed at its --lifetime costs its job no attempt
MOVES = 10  # ...but a job moved this many times by workers that left as planned (or with their scheduler) fails the run
HOST_START_TIMEOUT_S = 30
HOST_START_CHECK_S = 1.0  # while a host starts, whether its worker is still there is asked this often
LEAVING = frozenset({"closing", "closing_gracefully", "closed", "failed"})  # a worker in these takes no new host
REMOVAL_WAIT_S = 2.0  # how long a lost call waits for the scheduler to log how its worker went
WORKER_LIST_TTL_S = 1.0  # how long the list of able workers is trusted; a lost host refreshes it at once


class HostLost(RuntimeError):
    """The worker process holding a host died or was restarted while (or before) running a call."""

    def __init__(self, why: str, worker: str = ""):
        super().__init__(why)
        self.worker = worker  # the address lost, where known


class JobHost:
    """Lives on a Dask worker (an actor) and runs jobs there on its own threads.

    A job crosses as bytes both ways (cloudpickle's `(function, spec)` in, the result or a
    `JobFailure` out), unpickled inside `run` and `relay`: a job that cannot be read on the
    worker, or a result that cannot be read in the flow, fails its call in one line, where Dask's
    own deserialization would log the error and never answer the call."""

    def __init__(self) -> None:
        from distributed import get_worker

        from gymflow.tasks.cluster.jobs import import_job_machinery

        import_job_machinery()

        self._threads = ThreadPoolExecutor(get_worker().state.nthreads, thread_name_prefix="gymflow-job")

    async def run(self, job: bytes) -> bytes:
        context = contextvars.copy_context()  # the job sees its worker (distributed.get_worker), as a task would
        return await asyncio.get_running_loop().run_in_executor(self._threads, context.run, run_job, job)


@dataclass
class Call:
    """One job sent to one host; `future` holds its result, its exception or `HostLost`."""

    future: concurrent.futures.Future
    function: Callable[[Any], Any]
    spec: Any
    slot: int
    worker: str
    attempt: int
    deadline: float  # time.monotonic() after which the call counts as wedged
    connection: int = 0  # the pool's connection to its scheduler when sent (a new one after the scheduler was lost)
    moves: int = 0  # times sent again without counting an attempt (its worker left as planned, its scheduler was lost)

    def done(self) -> bool:
        return self.future.done()

    @property
    def finished(self) -> bool:
        """Done with its result or its job's own error, not with `HostLost`."""
        return self.future.done() and not isinstance(self.future.exception(), HostLost)


class Hosts(Protocol):
    """Where a run's jobs go: `HostPool` (Dask workers) or, in tests, gymflow.testing's
    in-process runner."""

    timeout_s: float
    closed: bool  # released: the run is ending, and jobs still out may fail for it
    one_process: bool  # every job runs in the flow's process, one after another

    def call(self, function: Callable[[Any], Any], spec: Any, slot: int, attempt: int = 1) -> Call:
        """Start `function(spec)` for `slot`; returns at once."""
        ...

    def settle(self, call: Call, logger: Logger | LoggerAdapter) -> Call:
        """`call` while it runs or once finished; sent again if its worker was lost or wedged."""
        ...

    def distinct_slots(self, slots: int) -> int:
        """How many of slots 0..slots-1 go to different workers (the first that many do)."""
        ...

    def for_evaluations(self) -> Hosts:
        """Where evaluations and films run: these hosts, or single mode's helper process."""
        ...

    def run_one_queued_here(self) -> bool:
        """Run on the caller's thread one job still queued for a host that is starting (single
        mode's helper), as a caller that would only wait for it can; whether there was one."""
        ...


class InProcessHosts:
    """Every job run at once, in this process, when it is called: `distribution.mode: single`
    (no Dask cluster; the same jobs, shards and checkpoints as a SYNC run, one after another), and
    the tests' stand-in for a cluster. A job's error is a one-line `JobFailed`, as on a worker."""

    timeout_s = 600.0  # never reached: a job is done when its call returns
    closed = False
    one_process = True

    def __init__(self, evaluations: Hosts | None = None) -> None:
        self.jobs: list[tuple[str, int]] = []  # (function name, slot) of every job run, in order
        self.evaluations = evaluations  # where evaluations run instead (single mode's helper process)

    def call(self, function: Callable[[Any], Any], spec: Any, slot: int, attempt: int = 1) -> Call:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.jobs.append((function.__name__, slot))
        import torch  # here: a flow's modules import none

        threads = torch.get_num_threads()  # a job takes one thread; the learner keeps its own
        try:
            with shards_kept_in_process():  # the learner takes them from memory
                future.set_result(function(spec))
        except Exception as error:  # noqa: BLE001 (the caller raises it, as a host would)
            where = f"{describe_job(function, spec, slot)} in the flow's process"
            future.set_exception(JobFailure.of(error).raised_by(where))
        finally:
            torch.set_num_threads(threads)
        return Call(future, function, spec, slot, "in-process", attempt, time.monotonic() + self.timeout_s)

    def settle(self, call: Call, logger: Logger | LoggerAdapter) -> Call:
        return call  # nothing is ever lost or wedged in-process

    def distinct_slots(self, slots: int) -> int:
        return 1  # one process

    def for_evaluations(self) -> Hosts:
        return self.evaluations or self

    def run_one_queued_here(self) -> bool:
        return False  # every job ran when it was called


class HostPool:
    """The run's hosts on the workers that offer `resources`; see the module's docstring. With a
    `link` (a scheduler the run does not own), a lost scheduler is waited for and its jobs in
    flight are sent again to the new one's workers, without counting as attempts
    (tasks/cluster/scheduler_link.py)."""

    def __init__(self, client: Client, resources: dict[str, float] | None, timeout_s: float, first_worker: int = 0,
                 link: SchedulerLink | None = None):
        """`first_worker`: slot 0's worker in the sorted list, so runs that share a cluster (a
        sweep's) start on different workers."""
        self.client, self.resources, self.timeout_s = client, resources or {}, timeout_s
        self.first_worker, self.link = first_worker, link
        self._hosts: dict[str, Future] = {}  # worker address -> the future of its host (an actor)
        self._actors: dict[str, Any] = {}  # worker address -> its host's proxy, once started
        self._lost: set[str] = set()  # addresses whose host died; skipped while the scheduler still lists them
        self._listed: tuple[float, list[str]] = (-math.inf, [])  # (when, able workers): a scheduler RPC saved per call
        self._lock = threading.Lock()  # calls come from the flow's thread and from Prefect task threads
        self._connection = 0  # bumped each time the link replaces a lost scheduler
        self._reconnecting = threading.Lock()  # one thread waits for the scheduler; the others wait for it
        self._unsettled: set[concurrent.futures.Future] = set()  # calls sent on this connection, not settled
        self._gone: Exception | None = None  # the scheduler was lost and none came back: every thread stops
        self.closed = False
        self.one_process = False

    def call(self, function: Callable[[Any], Any], spec: Any, slot: int, attempt: int = 1) -> Call:
        """Start `function(spec)` on the host of the worker for `slot`; returns at once."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            worker, actor, client, connection = self._host_for(slot)
        except HostLost as lost:
            future.set_exception(lost)
            return Call(future, function, spec, slot, lost.worker, attempt, time.monotonic() + self.timeout_s,
                        self._connection)

        job = cloudpickle.dumps((function, spec))
        where = f"{describe_job(function, spec, slot)} on the Dask worker {worker}"

        async def relay() -> None:
            try:
                reply = await actor.run(job)
            except asyncio.CancelledError:  # its client was closed: the scheduler was lost
                _lost(future, f"the worker {worker} was lost with its scheduler")
                raise
            except (OSError, RuntimeError) as error:  # the actor could not be reached: its worker is gone
                _lost(future, f"the worker {worker} was lost: {error}")
                return
            except Exception as error:  # noqa: BLE001 (whatever else Dask raises, the call ends)
                with suppress(InvalidStateError):
                    future.set_exception(JobFailed(where, f"its call failed: {one_line_cause(error)}"))
                return
            with suppress(InvalidStateError):  # settled as lost already: the scheduler went meanwhile
                settle_reply(future, where, reply)

        self._unsettled.add(future)
        future.add_done_callback(self._unsettled.discard)
        if self._connection != connection:  # the scheduler was replaced while this call was being sent
            _lost(future, f"the worker {worker} was lost with its scheduler")
        client.loop.add_callback(relay)
        return Call(future, function, spec, slot, worker, attempt, time.monotonic() + self.timeout_s, connection)

    def settle(self, call: Call, logger) -> Call:
        """`call` itself while it runs, or once it is `finished`; sent again (to a live worker) if
        its worker was lost, or if it is still running past its deadline (its worker is restarted
        first: a wedged thread cannot be stopped otherwise). Raises once a job has had its attempts."""
        if call.done():
            lost = call.future.exception()
            if not isinstance(lost, HostLost):
                return call
            if call.connection == self._connection:  # an address of an older scheduler's may be a new worker's
                self._forget(call.worker)
            if self._lost_with_its_scheduler(call):  # waits for a new scheduler
                return self._redo(call, f"{self._describe(call)} was lost with the Dask scheduler", logger,
                                  counted=False)
            if self._closed_itself(call.worker):  # at its lifetime: not the job's doing
                return self._redo(call, f"{self._describe(call)}: {lost} (it closed itself: not counted as an attempt)",
                                  logger, counted=False)
            return self._redo(call, f"{self._describe(call)}: {lost}", logger)
        if time.monotonic() <= call.deadline:
            return call
        if call.worker:
            with suppress(Exception):  # a scheduler gone meanwhile: the redo finds out
                self.client.restart_workers([call.worker], raise_for_error=False)
        self._forget(call.worker)
        return self._redo(call, f"{self._describe(call)} was still running after {self.timeout_s:.0f} s; "
                                f"restarted its worker {call.worker}", logger)

    def distinct_slots(self, slots: int) -> int:
        return max(1, min(slots, len(self._able_workers())))

    def for_evaluations(self) -> HostPool:
        return self

    def run_one_queued_here(self) -> bool:
        return False  # a job waits on its worker, never in the flow's process

    def start(self, slots: int) -> None:
        """Start the hosts of slots 0..slots-1 now, without waiting: they warm up (imports) while
        the run ships its code, not in its first job."""
        workers = self._able_workers()
        for slot in range(min(slots, len(workers))):
            self._host_future(workers[(slot + self.first_worker) % len(workers)])

    def close(self) -> None:
        """Release every host; their workers keep running (they may belong to a shared cluster)."""
        self.closed = True
        with self._lock:
            futures = list(self._hosts.values())
            self._hosts.clear()
            self._actors.clear()
        with suppress(Exception):  # a scheduler gone for good holds nothing of the run
            self.client.cancel(futures)

    def _redo(self, call: Call, reason: str, logger, counted: bool = True) -> Call:
        if counted and call.attempt >= ATTEMPTS:
            raise TimeoutError(f"{self._describe(call)} did not complete in {ATTEMPTS} attempts; the last: {reason}")
        moves = call.moves if counted else call.moves + 1
        if moves > MOVES:  # workers that never live long enough for the job (a --lifetime shorter than it)
            times = "once" if moves == 1 else f"{moves} times"
            raise TimeoutError(f"{self._describe(call)} did not complete: its worker left before it ended {times} "
                               f"(is the workers' --lifetime shorter than a job?); the last: {reason}")
        attempt = call.attempt + 1 if counted else call.attempt
        logger.warning("%s (attempt %d of %d); submitting the job again", reason, attempt, ATTEMPTS)
        redone = self.call(call.function, call.spec, call.slot, attempt)
        redone.moves = moves
        return redone

    @staticmethod
    def _describe(call: Call) -> str:
        return describe_job(call.function, call.spec, call.slot)

    def _host_for(self, slot: int) -> tuple[str, Any, Client, int]:
        """The worker for `slot`, its host, and the client and connection they belong to."""
        while True:  # the workers of the scheduler the client talks to
            with self._lock:
                client, connection = self.client, self._connection
            # may wait for a lost scheduler; and for a worker while none is up (all being replaced or leaving)
            workers = self._able_workers() or self._awaited_workers()
            if connection == self._connection:
                break
        worker = workers[(slot + self.first_worker) % len(workers)]
        actor = self._actors.get(worker)
        if actor is None:
            try:
                with client.as_current():  # the actor talks through the client it is read by
                    actor = self._actors[worker] = self._started_host(worker, client)
            except Exception as error:  # noqa: BLE001 (a worker gone or broken: the job goes elsewhere)
                self._forget(worker)
                raise HostLost(f"could not start a job host on {worker}: {error}", worker) from None
        return worker, actor, client, connection

    def _closed_itself(self, worker: str) -> bool:
        """Whether `worker` left as planned (its lifetime, a retirement Dask carried out), read from
        the scheduler's events of it once they hold its removal (waited for up to REMOVAL_WAIT_S);
        False for one that died (a crash, a kill, its nanny's memory limit), or when the scheduler
        cannot tell."""
        give_up_at = time.monotonic() + REMOVAL_WAIT_S
        while worker:
            try:
                events = self.client.get_events(worker)
            except Exception:  # noqa: BLE001 (a scheduler gone: counted, as before)
                return False
            if any(event.get("action") == "remove-worker" for _, event in events):
                return any(_closed_by_plan(event) for _, event in events)
            if time.monotonic() >= give_up_at:
                return False
            time.sleep(0.1)
        return False

    def _awaited_workers(self) -> list[str]:
        """The able workers once there is one, asked each second for up to `timeout_s`."""
        give_up_at = time.monotonic() + self.timeout_s
        while not (workers := self._able_workers()):
            if time.monotonic() >= give_up_at:
                offering = f" offering {self.resources}" if self.resources else ""
                raise HostLost(f"no Dask worker{offering} came up within {self.timeout_s:.0f} s")
            time.sleep(WORKER_LIST_TTL_S)
        return workers

    def _started_host(self, worker: str, client: Client) -> Any:
        """`worker`'s host once it has started. Raises at once if the worker leaves meanwhile (it
        retired, or died): Dask would keep the host's start waiting for that worker, which never
        comes back (its nanny starts a new one at a new address)."""
        future = self._host_future(worker, client)
        give_up_at = time.monotonic() + HOST_START_TIMEOUT_S
        while True:
            try:
                return future.result(min(HOST_START_CHECK_S, max(0.0, give_up_at - time.monotonic())))
            except TimeoutError:
                if time.monotonic() >= give_up_at:
                    raise TimeoutError(f"timed out after {HOST_START_TIMEOUT_S} s") from None
            if not _still_listed(worker, client):
                raise HostLost("the worker left while its host was starting")

    def _host_future(self, worker: str, client: Client | None = None) -> Future:
        with self._lock:
            if worker not in self._hosts:
                self._hosts[worker] = (client or self.client).submit(JobHost, workers=[worker], actor=True, pure=False)
            return self._hosts[worker]

    def _able_workers(self) -> list[str]:
        listed_at, listed = self._listed
        if time.monotonic() - listed_at > WORKER_LIST_TTL_S or not listed:
            listed = self._listed_by_scheduler()
            self._listed = (time.monotonic(), listed)
        with self._lock:
            self._lost &= set(listed)  # a lost address the scheduler dropped may come back as a new worker
            live = [address for address in listed if address not in self._lost]
        return live or listed

    def _listed_by_scheduler(self) -> list[str]:
        """The able workers, asked of the scheduler; a lost one is waited for (with a link)."""
        from gymflow.tasks.cluster.scheduler_link import SCHEDULER_ERRORS

        connection = self._connection
        try:
            identity = scheduler_identity_of(self.client)
            if self.link is None or identity["id"] == self.link.scheduler_id:
                return able_workers(identity, self.resources)
        except SCHEDULER_ERRORS as error:
            if self.link is None:
                raise HostLost(f"the Dask scheduler cannot be reached: {one_line_cause(error)}") from None
        self._reconnect(connection)  # lost, or replaced while Dask's client reconnected by itself
        return able_workers(scheduler_identity_of(self.client), self.resources)

    def _lost_with_its_scheduler(self, call: Call) -> bool:
        """Whether `call` was lost with its scheduler (which is then replaced, waiting for one)."""
        if self.link is None:
            return False
        if call.connection == self._connection and self.link.answers():
            return False
        self._reconnect(call.connection)
        return True

    def _reconnect(self, seen: int) -> None:
        """Replace the scheduler lost on connection `seen` (unless another thread did already):
        the link waits for one (raising past its wait), the hosts start anew on its workers, and
        calls still out on the old one are settled as lost."""
        with self._reconnecting:
            if self._gone is not None:
                raise self._gone
            if self._connection != seen:
                return
            try:
                client = self.link.reconnect()
            except Exception as gone:
                self._gone = gone
                raise
            with self._lock:
                self.client = client
                self._hosts.clear()
                self._actors.clear()
                self._lost.clear()
                self._listed = (-math.inf, [])
                self._connection += 1
                unsettled, self._unsettled = self._unsettled, set()
        for future in list(unsettled):  # settling one runs its callbacks, which take it out of the set
            _lost(future, "its worker was lost with the Dask scheduler")

    def _forget(self, worker: str) -> None:
        with self._lock:
            host = self._hosts.pop(worker, None)
            self._actors.pop(worker, None)
            self._lost.add(worker)
            self._listed = (-math.inf, [])
        if host is not None:
            with suppress(Exception):  # its scheduler may be gone with it
                self.client.cancel([host])


def _closed_by_plan(event: dict) -> bool:
    """A scheduler event saying its worker left as planned: removed as `expected` (a retirement
    Dask carried out), or closing at its `--lifetime` (which Dask's retirement refuses for a worker
    holding an actor, as each with a job host does, so that its removal reads as unexpected)."""
    return (event.get("action") == "remove-worker" and bool(event.get("expected"))) or (
        event.get("action") == "closing-worker" and event.get("reason") == "worker-lifetime-reached")


def _lost(future: concurrent.futures.Future, why: str) -> None:
    with suppress(InvalidStateError):  # settled already
        future.set_exception(HostLost(why))


def _still_listed(worker: str, client: Client) -> bool:
    """Whether the scheduler still lists `worker`, leaving or not (a retirement Dask refuses, for
    the actor it holds, leaves it working); True when the scheduler cannot tell."""
    from gymflow.tasks.cluster.scheduler_link import SCHEDULER_ERRORS

    try:
        return worker in scheduler_identity_of(client)["workers"]
    except SCHEDULER_ERRORS:
        return True


def scheduler_identity_of(client: Client) -> dict:
    from gymflow.tasks.cluster.scheduler_link import scheduler_identity  # Dask: imported by the runs that use it

    return scheduler_identity(client)


def able_workers(identity: dict, resources: dict[str, float] | None) -> list[str]:
    """The workers in a scheduler's `identity` offering every resource in `resources`, sorted by
    address; not those leaving (a retiring worker is `closing_gracefully` until it is gone)."""
    return sorted(
        address for address, info in identity["workers"].items()
        if all(info.get("resources", {}).get(name, 0) >= amount for name, amount in (resources or {}).items())
        and info.get("status") not in LEAVING
    )


def wait_first(calls: Iterable[Call], timeout_s: float) -> None:
    """Block until one of `calls` is done or `timeout_s` passes."""
    futures = [call.future for call in calls]
    if futures and timeout_s > 0:
        concurrent.futures.wait(futures, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)
