"""Dask's busiest housekeeping clocks as gymflow sets them in the clusters it starts (a run's
LocalCluster, `gymflow stack up`'s scheduler and workers, `distribution.slurm`'s scheduler and jobs): the event
loop's tick (Dask: every 20 ms), the memory monitor (100 ms) and the system monitor (500 ms), in
the scheduler, every worker and nanny, cost an idle 2-worker cluster 5.1-6.4 CPU-s a minute, 0.9-1.2
at these (benchmarks/cluster_idle.py; docs/cluster.md says what a user gives up: finer dashboard
plots). A stalled event loop is still reported past `distributed.admin.tick.limit` (3 s), and a
worker over its memory limit still stopped, half a second later at most. A cluster the user started
keeps its own."""

from __future__ import annotations

import shlex

HOUSEKEEPING_CLOCKS = {"distributed.admin.tick.interval": "500ms",
                       "distributed.worker.memory.monitor-interval": "500ms",
                       "distributed.admin.system-monitor.interval": "1s"}


def housekeeping_environment() -> dict[str, str]:
    """HOUSEKEEPING_CLOCKS as the environment of a Dask process started by command (Dask reads its
    DASK_* variables as it is imported: `distributed.admin.tick.interval` is
    DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL)."""
    return {"DASK_" + key.replace(".", "__").replace("-", "_").upper(): value
            for key, value in HOUSEKEEPING_CLOCKS.items()}


def housekeeping_exports() -> list[str]:
    """housekeeping_environment() as shell lines, for a job script run before its Dask workers."""
    return [f"export {name}={shlex.quote(value)}" for name, value in housekeeping_environment().items()]
