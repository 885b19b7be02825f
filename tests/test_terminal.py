"""The terminal of `gymflow run` reads: log lines printed above the progress bar, never into it; the
bar in one line of 80 columns; nothing of a bar in piped output (tests/test_what_users_see.py runs
the command piped)."""

from __future__ import annotations

import io
import logging
import re

from rich.console import Console

from gymflow.flows.cli import progress_bar
from gymflow.flows.console import printed_above

ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _screen_lines(written: str) -> list[str]:
    """What a terminal shows line by line: carriage returns and escapes redraw a line, not add to it."""
    return [ESCAPES.sub("", line) for line in re.split(r"[\r\n]", written) if ESCAPES.sub("", line).strip()]


def _terminal(width: int) -> tuple[io.StringIO, Console]:
    written = io.StringIO()
    return written, Console(file=written, force_terminal=True, width=width, color_system=None)


def test_a_log_line_is_printed_above_the_bar_never_glued_to_it(monkeypatch):
    from prefect.logging.handlers import PrefectConsoleHandler

    written, console = _terminal(100)
    handler = PrefectConsoleHandler(stream=written)  # stderr, which the bar draws on too
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("prefect.flow_runs")
    monkeypatch.setattr(logger, "handlers", [handler])
    monkeypatch.setattr(logger, "propagate", False)
    monkeypatch.setattr(logger, "level", logging.INFO)
    bar = progress_bar(console)
    with bar, printed_above(bar.console):
        task = bar.add_task("train", total=1000, status="v1 return 3.0", unit="env steps")
        bar.update(task, completed=300)
        bar.refresh()
        logger.info("run r1: rollout workers ready, training")
        bar.update(task, completed=600)
        bar.refresh()
    lines = _screen_lines(written.getvalue())
    said = [line for line in lines if "rollout workers ready" in line]
    assert said == ["run r1: rollout workers ready, training"]  # the whole line, nothing of the bar in it
    assert handler.console.file is written  # its own console back once the bar is gone


def test_the_bar_fits_80_columns_and_cuts_only_the_status():
    written, console = _terminal(80)
    bar = progress_bar(console)
    with bar:
        task = bar.add_task("train", total=200_000, status="", unit="env steps")
        bar.update(task, completed=22_528, status="v11 return 401.3 eval 401.3, delivering v10 to MLflow: its graph")
        bar.refresh()
    (line, *_) = [line for line in reversed(_screen_lines(written.getvalue())) if "env steps" in line]
    assert len(line) <= 80 and "22,528/200,000 env steps" in line and line.endswith("…")


def test_what_prefect_repeats_of_a_lost_server_stays_off_the_terminal(monkeypatch):
    """A run stopped for a lost server: Prefect's warning that the run's end (a gymflow error) could not be
    stored, and, while its API is out, its clients' lines about events not sent, used to stand between the
    outage's line and gymflow's last one; the run's log file keeps them. Other warnings stay."""
    from gymflow.flows.console import _PREFECT_CODE, GymflowErrorsSaidOnce, PrefectOutageSaidOnce
    from gymflow.tasks.tracking import prefect_watch

    def record(name: str, message: str, level: int = logging.WARNING) -> logging.LogRecord:
        return logging.LogRecord(name, level, f"{_PREFECT_CODE}/engine.py", 1, message, None, None)

    said_once = GymflowErrorsSaidOnce()
    assert not said_once.filter(record("prefect.flow_runs", "Failed to write result: Failed to serialize object of "
                                                            "type 'ServerLost' with serializer 'pickle'."))
    assert said_once.filter(record("prefect.flow_runs", "Failed to write result: of type 'dict'"))
    assert said_once.filter(record("prefect.flow_runs", "Flow run is taking long"))
    quiet, unsent = PrefectOutageSaidOnce(), record("prefect.events.clients", "Unable to connect to 'ws://h/api'")
    monkeypatch.setattr(prefect_watch, "_WATCHED", [])
    assert quiet.filter(unsent)  # no outage: a websocket a proxy blocks is worth a line
    outage = prefect_watch.prefect_outage("http://h/api", 300)
    outage.failed(ConnectionError("refused"))
    monkeypatch.setattr(prefect_watch, "_WATCHED", [outage])
    assert not quiet.filter(unsent) and quiet.filter(record("prefect.flow_runs", "something else"))
