"""Waiting for a flow's concurrent runs (a sweep's, a population's) in the main thread, where a stop lands.

CPython runs a signal's handler in the main thread, once that thread runs Python again; the kernel may
deliver Ctrl-C to any thread. Prefect's `as_completed` waits on an event with no timeout: a Ctrl-C that
landed on one of the runs' threads was held until a run ended (~10 s in a test sweep, minutes in a real
one). So the wait here is in slices, each a chance for the handler to run."""

from __future__ import annotations

import concurrent.futures
from typing import Any

from prefect.futures import PrefectConcurrentFuture

SLICE_S = 0.2


def first_finished(futures: list[PrefectConcurrentFuture[Any]]) -> PrefectConcurrentFuture[Any]:
    """The first of `futures` (task runs on Prefect's ThreadPoolTaskRunner) to finish; of several finished,
    the earliest in the list."""
    if not futures:
        raise ValueError("no futures to wait for")
    while True:
        done, _ = concurrent.futures.wait([future.wrapped_future for future in futures], timeout=SLICE_S,
                                          return_when=concurrent.futures.FIRST_COMPLETED)
        if done:
            return next(future for future in futures if future.wrapped_future in done)
