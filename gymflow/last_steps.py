"""What a process does before it ends at once (flows/stopping.py's `_exit_now`, a stop past its
grace): the steps that leave nothing behind which is not one of its child processes, such as a
SLURM job still in the queue. Each step is bounded by its owner and may fail; the exit goes on."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

_STEPS: dict[int, Callable[[], None]] = {}


@contextlib.contextmanager
def before_exit_now(step: Callable[[], None]) -> Iterator[None]:
    """`step` taken by `take_last_steps()` while inside."""
    _STEPS[id(step)] = step
    try:
        yield
    finally:
        _STEPS.pop(id(step), None)


def take_last_steps() -> None:
    for step in list(_STEPS.values()):
        with contextlib.suppress(Exception):
            step()
