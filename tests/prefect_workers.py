"""Stopping a `prefect worker` the tests started (tests/test_deployments.py, tests/test_team_stack.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import warnings
from pathlib import Path

import psutil

WORKER_STOP_S = 5  # a Prefect worker asked to stop ends within ~0.4-1.2 s here (~2 s under load), when it does
FLOW_RUNS_EXIT_S = 30  # a flow run's process exits within ~1 s of its final state, when it does


def stop_worker(process: subprocess.Popen, log: Path) -> None:
    """SIGTERM the worker (started with start_new_session) once the flow runs it started have
    exited, and end what is left in its session. A SIGTERM that reaches Prefect's worker while a
    flow-run process is still ending (the test has read its final state) races with that ending,
    and the worker then outlives it: one still running WORKER_STOP_S after it is SIGKILLed, with a
    warning naming its children then and the end of its log, `log`."""
    wait_for_no_children(process.pid, FLOW_RUNS_EXIT_S)
    left = _command_lines(psutil.Process(process.pid).children(recursive=True))
    process.terminate()
    try:
        process.wait(timeout=WORKER_STOP_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)
        warnings.warn(f"the Prefect worker ignored SIGTERM for {WORKER_STOP_S} s and was killed; its children "
                      f"then: {left}; its log ends: {log.read_text()[-2000:]}", stacklevel=2)
    finally:
        # What the worker left in its session ends too: a worker process of its own that outlived it
        # (seen: one ignoring SIGTERM, orphaned) polls the pool and takes later tests' runs; flow runs it left
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:  # nothing left in it
            pass


def wait_for_no_children(pid: int, seconds: float) -> None:
    """Wait until the process `pid` has no child processes left, or `seconds` have passed."""
    deadline = time.monotonic() + seconds
    while psutil.Process(pid).children(recursive=True) and time.monotonic() < deadline:
        time.sleep(0.2)


def _command_lines(processes: list[psutil.Process]) -> list[str]:
    """What each of `processes` runs; one that has ended meanwhile, or waits to be reaped, is left out."""
    lines = []
    for process in processes:
        try:
            lines.append(" ".join(process.cmdline()[:4]))
        except psutil.Error:  # ended, or a zombie: its command line is gone
            continue
    return lines
