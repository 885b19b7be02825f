"""What the terminal of `gymflow run` shows: gymflow's own lines, warnings and errors (one line).

The whole log (Prefect's engine lines, task runs begun and finished, libraries' INFO lines,
tracebacks) goes to the run's log file, `gymflow-logs/RUN_ID.log` in the working folder, and to
the Prefect API; the console shows what a person reads (`OnlyWhatAPersonReads`), and all of it
with `--verbose`.

Prefect's engine logs a failed task or flow with its traceback ("Encountered exception during
execution"), and its console handler prints it: dozens of lines of Prefect's and gymflow's frames
(and, for a job, the worker's) above the one line that says what is wrong. For gymflow's own
errors, which say it in that line, the console shows the line without the traceback; the run's
log in the Prefect API (its UI) keeps the traceback, the worker's included.

A run stopped from the terminal (Ctrl-C, SIGTERM) is said by gymflow itself ("gymflow: stopping",
then "gymflow: stopped." with the command that resumes it); Prefect's engine's "Crash detected!
Execution was aborted by an interrupt signal." (or "a termination signal") ERROR lines for the task
and the flow say it again,
as if something had broken: the console leaves them out (`InterruptNotACrash`), the API keeps them.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import prefect

from gymflow.errors import GymflowError


class WithoutGymflowTracebacks(logging.Formatter):
    """Formats as `inner` does, leaving out the traceback of a gymflow error."""

    def __init__(self, inner: logging.Formatter):
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info and isinstance(record.exc_info[1], GymflowError):
            record = copy.copy(record)  # the same record goes on to the API's handler, traceback and all
            record.exc_info, record.exc_text, record.stack_info = None, None, None
        return self.inner.format(record)


class InterruptNotACrash(logging.Filter):
    """Leaves out Prefect's lines about a run aborted by an interrupt or termination signal (a stop
    gymflow says itself)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "aborted by an interrupt signal" not in message and "aborted by a termination signal" not in message


class OnlyWhatAPersonReads(logging.Filter):
    """Warnings and errors, and gymflow's own INFO lines (its stages, progress and summary); not
    Prefect's engine lines (a task run begun, finished) nor libraries' INFO lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING or record.name.startswith("gymflow"):
            return True
        return record.name in RUN_LOGGERS and not record.pathname.startswith(_PREFECT_CODE)


UNSTORED_RESULT = "Failed to write result:"  # Prefect's warning where it could not store a run's end


class GymflowErrorsSaidOnce(logging.Filter):
    """Leaves out the ERROR lines Prefect's engine writes about a task or flow that a gymflow error ended
    (the task run failed, finished in state Failed, the flow run's exception), and its warning that
    such an end could not be stored as the run's result: gymflow's own line says it, once, last; the
    API and the run's log file keep them."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.pathname.startswith(_PREFECT_CODE):
            return True
        if record.levelno < logging.ERROR:  # but its warning that the run's end (a gymflow error) was not stored
            message = record.getMessage()
            return not (message.startswith(UNSTORED_RESULT) and
                        any(f"type '{name}'" in message for name in _gymflow_error_names()))
        if record.exc_info and isinstance(record.exc_info[1], GymflowError):
            return False
        message = record.getMessage()
        return not any(f"{name}: " in message for name in _gymflow_error_names())


def _gymflow_error_names() -> set[str]:
    found, kinds = set(), [GymflowError]
    while kinds:
        kind = kinds.pop()
        found.add(kind.__name__)
        kinds.extend(kind.__subclasses__())
    return found


class PrefectOutageSaidOnce(logging.Filter):
    """While the Prefect API is out (gymflow says so once, then its end or loss in one line), leaves
    out what Prefect's own clients say of it again and again: events not sent over the websocket,
    their service failing with items pending. The run's log file keeps them."""

    QUIET = ("prefect.events.clients", "prefect._internal.concurrency")

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(self.QUIET):
            return True
        from gymflow.tasks.tracking.prefect_watch import api_out

        return not api_out()


class NotTheBarsLines(logging.Filter):
    """Leaves out the progress lines (tasks/tracking/progress.py) while a bar shows the same."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.pathname.endswith(_PROGRESS_CODE)


_PROGRESS_CODE = str(Path("tracking", "progress.py"))


@contextmanager
def printed_above(console: Any) -> Iterator[None]:
    """While a progress bar is drawn on `console` (rich's), Prefect's console handlers print through it,
    above the bar and never into it, without the progress lines the bar shows."""
    handlers = _console_handlers()
    before = [handler.console for handler in handlers]
    hidden = NotTheBarsLines()
    for handler in handlers:
        handler.console = console
        handler.addFilter(hidden)
    try:
        yield
    finally:
        for handler, own in zip(handlers, before):
            handler.console = own
            handler.removeFilter(hidden)


def _console_handlers() -> list[Any]:
    from prefect.logging.handlers import PrefectConsoleHandler

    handlers: list[Any] = []
    for name in ("prefect", "prefect.flow_runs", "prefect.task_runs", ""):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, PrefectConsoleHandler) and handler not in handlers:
                handlers.append(handler)
    return handlers


RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")  # what get_run_logger() gives gymflow's flows and tasks
_PREFECT_CODE = str(Path(prefect.__file__).parent)
LOG_FOLDER = "gymflow-logs"


def forget_log(path: Path) -> None:
    """A command refused in one line leaves nothing behind: its log file goes (the Prefect API
    keeps the run's log, traceback and all)."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
        if handler.baseFilename == str(path.resolve()):
            root.removeHandler(handler)
            handler.close()
    path.unlink(missing_ok=True)
    if path.parent.is_dir() and not any(path.parent.iterdir()):
        path.parent.rmdir()


def log_to_file_and_console(name: str, verbose: bool) -> Path:
    """The whole log into `gymflow-logs/NAME.log` (appended: a resumed run's continues its file),
    the console filtered unless `verbose`. Returns the file's path."""
    from prefect.logging.handlers import PrefectConsoleHandler

    path = Path(LOG_FOLDER, f"{name}.log")
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    if not any(isinstance(h, logging.FileHandler) and h.baseFilename == str(path.resolve()) for h in root.handlers):
        handler = logging.FileHandler(path, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    for handler in root.handlers:
        if isinstance(handler, PrefectConsoleHandler) and not verbose:
            handler.addFilter(OnlyWhatAPersonReads())
    return path


def gymflow_errors_in_one_line_on_the_console() -> None:
    """Wrap the formatter of each of Prefect's console handlers, and filter them (once)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    for name in ("prefect", "prefect.flow_runs", "prefect.task_runs", ""):
        for handler in logging.getLogger(name).handlers:
            wrapped = isinstance(handler.formatter, WithoutGymflowTracebacks)
            if isinstance(handler, PrefectConsoleHandler) and not wrapped:
                handler.setFormatter(WithoutGymflowTracebacks(handler.formatter or logging.Formatter()))
                handler.addFilter(InterruptNotACrash())
                handler.addFilter(GymflowErrorsSaidOnce())
                handler.addFilter(PrefectOutageSaidOnce())
    for handler in logging.getLogger("prefect._internal").handlers:  # its own stderr handler (no propagation)
        if not any(isinstance(kept, PrefectOutageSaidOnce) for kept in handler.filters):
            handler.addFilter(PrefectOutageSaidOnce())
