"""Single mode's helper process: evaluation and film jobs run there, on another core, while the
learner learns in the flow's process (JORLDY's manage process). On a thread of the flow's
process they shared the GIL with the learner: on CartPole an evaluation beside the learner took
twice its own time and slowed learning by as much again (docs/benchmarks.md, single mode).

The helper is `python -m gymflow.tasks.cluster.helper` (this module's `serve`), a child that talks in
frames (tasks/cluster/wire.py's `start_child`: the flow's import path, a session of its own). Jobs
cross its stdin and stdout as length-prefixed frames of bytes and run one at a time, in the order
they were sent; what a job prints goes to stderr. It exits when its stdin closes: when the flow
closes it, or when the flow dies.

The helper only makes single mode faster, never different. A job sent while it is still starting
(its imports take a second or two, and a CartPole run's first evaluation comes sooner) waits for
it in a queue, unless the loop's thread comes to wait for the job's result first and runs it
itself (`run_one_queued_here`): run on the evaluation thread instead, beside the learner, a
CartPole evaluation took four times as long and slowed the learner (the GIL). A job sent after
the helper died, or queued when it dies, runs in the flow's process, with the same result.
"""

from __future__ import annotations

import concurrent.futures
import gc
import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from logging import Logger, LoggerAdapter
from typing import Any

import cloudpickle

from gymflow.imports import uncollected
from gymflow.tasks.cluster.hosts import Call, HostLost, Hosts
from gymflow.tasks.cluster.wire import (
    CHILD_START_TIMEOUT_S,
    describe_job,
    frames_out,
    read_frame,
    run_job,
    settle_reply,
    start_child,
    write_frame,
)
from gymflow.tasks.storage.objects import settle_writes

STOP_WAIT_S = 5.0  # a job still running when the flow closes the helper is given this long, then killed
# where the helper and the learner both want a core (the Prefect API wanting the other), the learner
# gets it. Alternating runs, the benchmark's ratio: DQN 1.07 against 1.09, PPO 1.03 against 1.04
# (docs/benchmarks.md)
HELPER_NICENESS = 5


@dataclass(frozen=True)
class _Queued:
    """A job sent before the helper was ready."""

    function: Callable[[Any], Any]
    spec: Any
    slot: int
    attempt: int
    job: bytes
    future: concurrent.futures.Future
    where: str


class HelperProcess:
    """Hosts for the jobs that run beside the learner in single mode: one helper process."""

    timeout_s = 600.0  # never reached: a job is done when the helper answers, or fails when it exits
    closed = False
    one_process = False  # the helper's, beside the flow's (which runs the jobs while the helper starts)

    def __init__(self, instead: Hosts) -> None:
        """`instead`: where jobs run while the helper starts, or once it has died."""
        self.instead = instead
        self.process = start_child("gymflow.tasks.cluster.helper")  # a helper not ready in time is ended:
        self._waiting: deque[tuple[concurrent.futures.Future, str]] = deque()  # sent, in order, not answered
        self._queued: deque[_Queued] = deque()  # sent before the helper was ready, in order
        self._ready = threading.Event()  # set once the helper has imported what jobs need
        self._gone = ""  # why no job can run there any more
        self._lock = threading.Lock()
        self._replies = threading.Thread(target=self._read_replies, name="helper-replies", daemon=True)
        self._replies.start()
        self._start_deadline = threading.Timer(CHILD_START_TIMEOUT_S, self._end_if_not_ready)  # its jobs run here
        self._start_deadline.daemon = True
        self._start_deadline.start()

    @property
    def ready(self) -> bool:
        """Started and not gone: jobs run there."""
        return self._ready.is_set() and not self._gone

    def call(self, function: Callable[[Any], Any], spec: Any, slot: int, attempt: int = 1) -> Call:
        settle_writes()  # the job reads what this process wrote (a policy version)
        future: concurrent.futures.Future = concurrent.futures.Future()
        where = f"{describe_job(function, spec, slot)} in the helper process (pid {self.process.pid})"
        job = cloudpickle.dumps((function, spec))
        with self._lock:  # the replies' reader settles what is waiting when the helper exits, under it too
            taken = not self._gone
            if taken and self._ready.is_set():
                self._send(job, future, where)
            elif taken:
                self._queued.append(_Queued(function, spec, slot, attempt, job, future, where))
        if not taken:
            return self.instead.call(function, spec, slot, attempt)
        return Call(future, function, spec, slot, f"helper:{self.process.pid}", attempt,
                    time.monotonic() + self.timeout_s)

    def run_one_queued_here(self) -> bool:
        """Run the oldest job still waiting for the helper to start on this thread, in the flow's
        process (`instead`), the same job with the same result; whether there was one."""
        with self._lock:
            if not self._queued:
                return False
            queued = self._queued.popleft()
        outcome = self.instead.call(queued.function, queued.spec, queued.slot, queued.attempt).future
        if outcome.exception() is not None:
            queued.future.set_exception(outcome.exception())
        else:
            queued.future.set_result(outcome.result())
        return True

    def settle(self, call: Call, logger: Logger | LoggerAdapter) -> Call:
        """`call`; sent again to `instead` if the helper died under it."""
        if call.done() and isinstance(lost := call.future.exception(), HostLost):
            logger.warning("%s; the job runs in the flow's process instead", lost)
            return self.instead.call(call.function, call.spec, call.slot, call.attempt + 1)
        return call

    def distinct_slots(self, slots: int) -> int:
        return 1

    def for_evaluations(self) -> HelperProcess:
        return self

    def close(self) -> None:
        """End the helper: at once if a job is still running (the run is stopping), else once it
        has read the end of its input."""
        self.closed = True
        self._start_deadline.cancel()
        with self._lock:
            busy = bool(self._waiting or self._queued)
        if busy:
            self.process.kill()
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._replies.join(STOP_WAIT_S)

    def _send(self, job: bytes, future: concurrent.futures.Future, where: str) -> None:
        """Under the lock: `job` to the helper, its answer awaited in order."""
        self._waiting.append((future, where))
        try:
            write_frame(self.process.stdin, job)
        except OSError:  # the helper exited: its replies' reader fails the call
            pass

    def _read_replies(self) -> None:
        if read_frame(self.process.stdout) is not None:  # its first frame says it is ready
            with self._lock:
                self._ready.set()
                while self._queued:
                    queued = self._queued.popleft()
                    self._send(queued.job, queued.future, queued.where)
        while (reply := read_frame(self.process.stdout)) is not None:
            with self._lock:
                future, where = self._waiting.popleft()
            settle_reply(future, where, reply)
        code = self.process.wait()
        with self._lock:
            self._gone = f"the helper process (pid {self.process.pid}) exited with code {code}"
            unanswered = [*self._waiting, *((queued.future, queued.where) for queued in self._queued)]
            self._waiting.clear()
            self._queued.clear()
        for future, where in unanswered:
            future.set_exception(HostLost(f"{where}: {self._gone}"))

    def _end_if_not_ready(self) -> None:
        if not self._ready.is_set():  # a helper that cannot start must not hold its jobs
            self.process.kill()


def serve() -> None:
    """The helper's side: say it is ready (an empty frame), then run each job read from stdin and
    answer each on the original stdout."""
    if hasattr(os, "nice"):  # not on Windows
        os.nice(HELPER_NICENESS)
    with uncollected(freeze=True):  # the helper keeps what it imports for its life
        from gymflow.tasks.cluster.jobs import import_job_machinery

        import_job_machinery()

    replies = frames_out()
    write_frame(replies, b"")  # ready
    jobs = sys.stdin.buffer
    while (job := read_frame(jobs)) is not None:
        write_frame(replies, run_job(job))
    # the helper ends next, and the flow waits for it: no collection of its whole heap (torch,
    # Gymnasium) on the way out (~0.5 s), as the command line's own exit
    gc.freeze()


if __name__ == "__main__":  # the helper: its jobs' failures must pickle as wire's types, not __main__'s
    from gymflow.tasks.cluster import helper

    helper.serve()
