"""Set-up of a LocalCluster's worker processes (a Dask preload): they belong to the flow.

A signal meant for the flow's process group (a Prefect worker cancelling a deployment run sends
SIGTERM to the whole group; a terminal's Ctrl-C sends SIGINT to it) would otherwise end them
at once, before the flow has stopped using them, and their nannies would start new ones, which
the flow's closing cluster must then wait for (2-3 s of imports). So they ignore both, as
multiprocessing's resource tracker does: they leave when the flow closes the cluster, or with
the flow's process (distributed ends a worker process whose parent is gone).
"""

from __future__ import annotations

import signal


def dask_setup(worker: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
