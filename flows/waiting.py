"""Waiting for a flow's concurrent runs (a sweep's, a population's) in the main thread, where a stop's
handler runs. Prefect's `as_completed` blocks on an event with no timeout; here the wait is in slices of
`SLICE_S`, so the main thread comes back to Python, where CPython runs signal handlers, several times a
second whatever its runs do."""

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
