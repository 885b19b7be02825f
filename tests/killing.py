"""A training flow run in a process of its own and SIGKILLed midway, as a crash would end it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.stored import newest_published


def kill_flow_midway(preset: str, overrides: dict, root: Path, log: Path, kill_at: int) -> None:
    """Run `improve(preset, overrides)` (storage under `root`) in a new process group, and SIGKILL
    the group — the flow's process, its Dask scheduler and workers — once version `kill_at` or a
    newer one is published. Fails if the flow ends first (its output is in the message)."""
    from prefect.settings import PREFECT_API_URL

    with log.open("wb") as output:
        flow = subprocess.Popen(
            [sys.executable, "-c", ("import json, sys\nfrom gymflow.flows.improve import improve\n"
                                    "if __name__ == '__main__':\n    improve(sys.argv[1], json.loads(sys.argv[2]))"),
             preset, json.dumps(overrides)],
            env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
            start_new_session=True, stdout=output, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 180
        while newest_published(root) < kill_at:  # a fast run retires v{kill_at} before a poll may see it
            assert flow.poll() is None and time.monotonic() < deadline, (
                f"the flow ended before it could be killed (exit {flow.poll()}):\n{log.read_text()[-3000:]}")
            time.sleep(0.05)
        os.killpg(flow.pid, signal.SIGKILL)  # single mode: its helper has a session of its own, and ends when
        # its input does
        flow.wait()
