"""What a process does before it ends at once (flows/stopping.py's `_exit_now`, a stop past its
grace; `end_within`, a run whose end a lost server holds up): the steps that leave nothing behind
which is not one of its child processes, such as a SLURM job still in the queue. Each step is
bounded by its owner and may fail; the exit goes on."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

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


class _Deadline(NamedTuple):
    """The one deadline armed in this process: its timer, its line, when it is due (monotonic)."""

    timer: threading.Timer
    line: str
    due: float


_ENDING: list[_Deadline] = []  # none or one
_SAID: list[str] = []
_ALLOWED: list[bool] = []  # a process of gymflow's own (the command, a deployment's flow run): it may be ended
_HOLDS: list[str] = []  # what a deadline waits for before it ends the process
HOLD_LIMIT_S = 600.0  # the longest a deadline waits for what holds it


@contextlib.contextmanager
def held(what: str) -> Iterator[None]:
    """While inside, a deadline that comes (`end_within`) waits for this to finish, up to
    HOLD_LIMIT_S: a delivery to an MLflow server that answers, the MLflow run's last state."""
    _HOLDS.append(what)
    try:
        yield
    finally:
        _HOLDS.remove(what)


def allow_ending() -> None:
    """This process is a run's own (`gymflow run`, a deployment's flow-run process): a deadline may end it.
    Elsewhere (a notebook, a test calling the flow) `end_within` arms nothing: the caller goes on."""
    _ALLOWED.append(True)


def pending_line() -> str | None:
    """The line of the deadline armed in this process (a server lost), if any."""
    return _ENDING[0].line if _ENDING else None


def cancel_end() -> None:
    """The deadline taken back: the command returned to a caller that goes on (a test, a notebook)."""
    _cancel_timer()
    _SAID.clear()


def _cancel_timer() -> None:
    while _ENDING:
        _ENDING.pop().timer.cancel()


def end_within(seconds: float, line: str, code: int = 2) -> None:
    """Where this process still runs `seconds` from now (its end held up by a server that is gone:
    a client that tries it again for minutes), `line` said on stderr unless said already
    (`said`), the last steps taken (what is `held` finished first), its child processes ended, and it
    ends with `code`. Once: a later call changes it only to a sooner end. Only in a process
    `allow_ending` marked as a run's own."""
    if not _ALLOWED:
        return
    due = time.monotonic() + seconds
    if _ENDING:
        if _ENDING[0].due <= due:
            return
        _cancel_timer()  # a sooner deadline (the run's work is over; only its report is left) takes its place
    timer = threading.Timer(seconds, _end_now, (line, code))
    timer.daemon = True
    _ENDING.append(_Deadline(timer, line, due))
    timer.start()


def said(line: str) -> None:
    """`line` was said on stderr (the command's own error line): `end_within` does not say it again."""
    _SAID.append(line)


def _end_now(line: str, code: int) -> None:
    import psutil

    waited_until = time.monotonic() + HOLD_LIMIT_S
    while _HOLDS and time.monotonic() < waited_until:  # a delivery under way finishes first
        time.sleep(0.2)

    if not _SAID:
        print(line, file=sys.stderr, flush=True)
    take_last_steps()
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()
    os._exit(code)
