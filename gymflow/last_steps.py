"""What a process does before it ends at once (flows/stopping.py's `_exit_now`, a stop past its
grace; `end_within`, a run whose end a lost server holds up): the steps that leave nothing behind
which is not one of its child processes, such as a SLURM job still in the queue. Each step is
bounded by its owner and may fail; the exit goes on."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
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


_ENDING: list[threading.Timer] = []
_SAID: list[str] = []


def end_within(seconds: float, line: str, code: int = 2) -> None:
    """Where this process still runs `seconds` from now (its end held up by a server that is gone:
    a client that tries it again for minutes), `line` said on stderr unless said already
    (`said`), the last steps taken, its child processes ended, and it ends with `code`. Once."""
    if _ENDING:
        return
    timer = threading.Timer(seconds, _end_now, (line, code))
    timer.daemon = True
    _ENDING.append(timer)
    timer.start()


def said(line: str) -> None:
    """`line` was said on stderr (the command's own error line): `end_within` does not say it again."""
    _SAID.append(line)


def _end_now(line: str, code: int) -> None:
    import psutil

    if not _SAID:
        print(line, file=sys.stderr, flush=True)
    take_last_steps()
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()
    os._exit(code)
