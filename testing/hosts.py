"""An in-process stand-in for the Dask job hosts: each job runs in the calling thread when it is
called, so the improve loop, its stop rule, its evaluation schedule and the ASYNC ratio can be
exercised in milliseconds, without a cluster.

    loop = ImproveLoop(..., SyncRounds(InProcessHosts(), plan, exploration, logger), ...)
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from logging import Logger, LoggerAdapter
from typing import Any

from gymflow.tasks.cluster.hosts import Call


class InProcessHosts:
    """Runs every job at once, in this process; a job's own error is raised as itself."""

    timeout_s = 600.0
    closed = False

    def __init__(self) -> None:
        self.jobs: list[tuple[str, int]] = []  # (function name, slot) of every job run, in order

    def call(self, function: Callable[[Any], Any], spec: Any, slot: int, attempt: int = 1) -> Call:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.jobs.append((function.__name__, slot))
        try:
            future.set_result(function(spec))
        except Exception as error:  # noqa: BLE001 (the caller raises it, as a host would)
            future.set_exception(error)
        return Call(future, function, spec, slot, "in-process", attempt, time.monotonic() + self.timeout_s)

    def settle(self, call: Call, logger: Logger | LoggerAdapter) -> Call:
        return call  # nothing is ever lost or wedged in-process

    def distinct_slots(self, slots: int) -> int:
        return 1  # one process
