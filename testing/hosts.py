"""An in-process stand-in for the Dask job hosts: each job runs in the calling thread when it is
called, so the improve loop, its stop rule, its evaluation schedule and the ASYNC ratio can be
exercised in milliseconds, without a cluster.

    loop = ImproveLoop(..., SyncRounds(InProcessHosts(), plan, exploration, logger), ...)
"""

from __future__ import annotations

from gymflow.tasks.cluster.hosts import InProcessHosts

__all__ = ["InProcessHosts"]
