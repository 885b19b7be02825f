"""A command's stop as its other threads see it. Ctrl-C or SIGTERM reaches the main thread alone, as a
KeyboardInterrupt (flows/stopping.py); a sweep's runs train in Prefect's task threads, which would go
on collecting from a cluster the main thread is closing. So the stop is asked here too: a run in
another thread ends at its next step (`end_if_stopped`), as a run in the main thread does at once,
and the main thread waits for those runs before it closes what they use (flows/sweep.py). A leaf:
anything may import it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_ASKED = threading.Event()


@contextmanager
def stoppable() -> Iterator[None]:
    """A command that `ask_stop()` may stop; on the way out its stop is forgotten (a process that runs
    commands one after another, as tests do, starts each unstopped)."""
    _ASKED.clear()
    try:
        yield
    finally:
        _ASKED.clear()


def ask_stop() -> None:
    """Stop every run of this command, in whatever thread (the signal handler asks)."""
    _ASKED.set()


def stopped() -> bool:
    """Whether this command was asked to stop."""
    return _ASKED.is_set()


def end_if_stopped() -> None:
    """Raise the stop in a thread other than the main one (which has it already) once it was asked."""
    if _ASKED.is_set() and threading.current_thread() is not threading.main_thread():
        raise KeyboardInterrupt


_INSIDE = threading.Condition()
_RUNS = [0]  # runs inside `a_run()` now


@contextmanager
def a_run() -> Iterator[None]:
    """A run inside, in whatever thread: `runs_ended_first` waits for it to leave. A run that begins after
    the stop was asked ends at once."""
    with _INSIDE:
        _RUNS[0] += 1
    try:
        end_if_stopped()
        yield
    finally:
        with _INSIDE:
            _RUNS[0] -= 1
            _INSIDE.notify_all()


@contextmanager
def runs_ended_first(timeout_s: float) -> Iterator[None]:
    """A command whose runs train in other threads: left by a stop or an error (Prefect's engine raises its own
    TerminationSignal for a SIGTERM, before gymflow's handler sees it), it stops them and waits (up to
    `timeout_s`) for them to end, each at its next step closing its hosts and MLflow run, before what they use
    is closed."""
    try:
        yield
    except BaseException:
        asked_here = not _ASKED.is_set()
        _ASKED.set()
        with _INSIDE:
            ended = _INSIDE.wait_for(lambda: _RUNS[0] == 0, timeout_s)
        if asked_here and ended:  # a process that goes on (a test, a notebook) starts its next command unstopped;
            _ASKED.clear()  # a run still going keeps seeing the stop (Prefect's task runner waits for its thread)
        raise
