"""MLflow system metrics of a run, per node: the flow's process (`flow-HOST`) and each rollout
worker process (`worker-HOST-PID`), as `system/NODE/cpu_utilization_percentage`, `.../
system_memory_usage_megabytes`, `.../process_memory_rss_megabytes`, `.../gpu_0_utilization_percentage`
(MLflow's names, and its node-id prefix, so its UI groups them as its own). Logged at the run's
clock (env steps), each node at most every `every_seconds`: a sample rides on each shard a worker
lands, so nothing is asked of the workers."""

from __future__ import annotations

import time
from collections.abc import Mapping

from gymflow.tasks.cluster.host_figures import node_id, sample_host
from gymflow.tasks.tracking.tracker import Tracker

EVERY_SECONDS = 10.0


class SystemMetrics:
    def __init__(self, tracker: Tracker, every_seconds: float = EVERY_SECONDS):
        self.tracker, self.every_seconds = tracker, every_seconds
        self.flow_node = node_id("flow")
        self._last: dict[str, float] = {}  # node -> when it was last logged

    def record(self, workers: Mapping[str, Mapping[str, float]], step: int) -> None:
        """Log the workers' newest samples and the flow's own, those whose node is due."""
        now = time.monotonic()
        due = [node for node in (self.flow_node, *workers) if now - self._last.get(node, -1e9) >= self.every_seconds]
        if not due:
            return
        figures = {**workers, self.flow_node: sample_host().metrics()} if self.flow_node in due else dict(workers)
        metrics = {f"system/{node}/{name}": value for node in due for name, value in figures[node].items()}
        self.tracker.log_metrics(metrics, step=step)
        self._last.update(dict.fromkeys(due, now))
