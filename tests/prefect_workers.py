"""Stopping a `prefect worker` the tests started (tests/test_deployments.py, tests/test_team_stack.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import warnings
from pathlib import Path

import psutil

WORKER_STOP_S = 5  # a Prefect worker asked to stop ends within ~0.4-1.2 s here (~2 s under load)


def stop_worker(process: subprocess.Popen, log: Path) -> None:
    """SIGTERM the worker (started with start_new_session), and end what is left in its session.
    Prefect's worker stops on SIGTERM by sending itself SIGINT: it outlived every SIGTERM where the
    suite was started with SIGINT ignored (a background job of a script; tests/conftest.py restores
    it). One still running after WORKER_STOP_S is SIGKILLed, with a warning naming its children then
    and the end of its log, `log`."""
    try:
        left = _command_lines(psutil.Process(process.pid).children(recursive=True))
    except psutil.Error:  # it has ended already (its session may still hold processes)
        left = []
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


def _command_lines(processes: list[psutil.Process]) -> list[str]:
    """What each of `processes` runs; one that has ended meanwhile, or waits to be reaped, is left out."""
    lines = []
    for process in processes:
        try:
            lines.append(" ".join(process.cmdline()[:4]))
        except psutil.Error:  # ended, or a zombie: its command line is gone
            continue
    return lines
