"""Progress of a training run: logged to the flow run, shown as its Prefect progress artifact, and
drawn as a bar by the CLI."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol


class ProgressView(Protocol):
    def update(self, done: int, total: int, unit: str, status: str) -> None: ...

    def finish(self, done: int, total: int, unit: str, status: str) -> None:
        """The run is over after `done` of `total` (fewer where a target or a pruner stopped it): the
        view shows it whole, with `status`, the outcome."""


_views: list[ProgressView] = []


@contextmanager
def showing_progress(view: ProgressView) -> Iterator[None]:
    """While inside, every training run in this process reports to `view`."""
    _views.append(view)
    try:
        yield
    finally:
        _views.remove(view)


class ProgressLog:
    """Reports progress to the process's views, the run's own `views` (its Prefect progress
    artifact), and to a logger at most every `every_s` seconds."""

    def __init__(self, logger, total: int, every_s: float = 10.0, views: Sequence[ProgressView] = (),
                 unit: str = "env steps"):
        self.logger = logger
        self.total, self.unit = total, unit
        self.every_s = every_s
        self.views = tuple(views)
        self._last_log = 0.0

    def update(self, done: int, status: str, force: bool = False) -> None:
        """`done` of the run's budget (in `unit`) spent."""
        for view in (*_views, *self.views):
            view.update(done, self.total, self.unit, status)
        now = time.monotonic()
        if force or now - self._last_log >= self.every_s:
            self._last_log = now
            share = 100.0 * min(done / self.total, 1.0)
            self.logger.info("%s/%s %s (%.0f%%) %s", f"{done:,}", f"{self.total:,}", self.unit, share, status)

    def finish(self, done: int, status: str) -> None:
        """The run is over (delivered): every view shows it done with `status`, the last line logged."""
        for view in (*_views, *self.views):
            view.finish(done, self.total, self.unit, status)
        stopped = "" if done >= self.total else f" (stopped at {100.0 * done / self.total:.0f}% of its budget)"
        self.logger.info("%s/%s %s (100%%) %s%s", f"{done:,}", f"{self.total:,}", self.unit, status, stopped)
