"""Run a Python module as a helper process that ends when the process that started it dies.

    python -m gymflow.flows.tethered PARENT_PID MODULE [ARGS...]

A helper in a session of its own (the temporary Prefect API, out of reach of the terminal's
Ctrl-C) outlives a parent killed without a chance to stop it — SIGKILL, the OOM killer — and was
found still listening, 230 MB resident, half an hour later. Here a thread watches the parent, as
a Dask worker watches its nanny: once the parent is gone the helper is asked to stop (SIGTERM,
which a server answers by shutting down) and, if it has not within `STOP_GRACE_S`, ends at once.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time

POLL_S = 0.5
STOP_GRACE_S = 5.0


def watch_parent(parent_pid: int) -> None:
    """Stop this process once `parent_pid` is no longer its parent (it died; init adopted us)."""
    while os.getppid() == parent_pid:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(STOP_GRACE_S)
    os._exit(1)


def main(argv: list[str]) -> None:
    parent_pid, module, *arguments = argv
    if os.getppid() != int(parent_pid):  # the parent died while this process started
        sys.exit(1)
    threading.Thread(target=watch_parent, args=(int(parent_pid),), name="gymflow-tether", daemon=True).start()
    sys.argv = [module, *arguments]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
