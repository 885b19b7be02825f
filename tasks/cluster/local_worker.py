"""Set-up of a LocalCluster's worker processes (a Dask preload): they belong to the flow.

A signal meant for the flow's process group (a Prefect worker cancelling a deployment run sends
SIGTERM to the whole group; a terminal's Ctrl-C sends SIGINT to it) would otherwise end them
at once, before the flow has stopped using them, and their nannies would start new ones, which
the flow's closing cluster must then wait for (2-3 s of imports). So they ignore both, as
multiprocessing's resource tracker does: they leave when the flow closes the cluster, or with
the flow's process (distributed ends a worker process whose parent is gone).

And a worker that closes may cut its own heartbeat short: `Worker.close` stops the heartbeat's
timer, but a heartbeat already on its way to the scheduler goes on, and the worker then closes
its connections under it (`await self.rpc.close()`), which logs "Failed to communicate with
scheduler during heartbeat" with a traceback, on the run's terminal, after the run has stopped
(Dask's own race: NVIDIA-NeMo/Curator#9, nv-morpheus/Morpheus#1990). That record is dropped
while the worker is closing; a heartbeat that fails while it runs is still logged.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

HEARTBEAT_CUT = "Failed to communicate with scheduler during heartbeat"


class HeartbeatCutByClose(logging.Filter):
    """Drops the heartbeat failure a closing `worker` causes itself."""

    def __init__(self, worker: Any):
        super().__init__()
        self.worker = worker

    def filter(self, record: logging.LogRecord) -> bool:
        from distributed.core import Status

        closing = self.worker.status in (Status.closing, Status.closed, Status.closing_gracefully)
        return not (closing and record.getMessage().startswith(HEARTBEAT_CUT))


def dask_setup(worker: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("distributed.worker").addFilter(HeartbeatCutByClose(worker))
