"""What the Prefect UI shows of a run besides its task runs: a progress bar that moves as training
advances, the table of its evaluations, and the summary (written by tasks/training/delivery.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact

PROGRESS_KEY, EVALUATIONS_KEY = "improve-progress", "improve-evaluations"


class ProgressArtifact:
    """The run's progress artifact: percent of the budget (env steps; offline: gradient steps),
    and the status line as its description; sent to the API at most every `every_s` seconds (each
    update is a request)."""

    def __init__(self, run_id: str, every_s: float = 2.0):
        self.run_id, self.every_s = run_id, every_s
        self.artifact_id = create_progress_artifact(0.0, key=PROGRESS_KEY, description=f"gymflow run {run_id}")
        self._sent = 0.0

    def update(self, done: int, total: int, unit: str, status: str) -> None:
        now = time.monotonic()
        if now - self._sent < self.every_s and done < total:
            return
        self._sent = now
        update_progress_artifact(self.artifact_id, 100.0 * min(done / total, 1.0),
                                 description=f"gymflow run {self.run_id}: {done:,}/{total:,} {unit}, {status}")


def publish_evaluations(run_id: str, rows: Sequence[tuple[int, float, float, float, int | None]],
                        unit: str = "env steps") -> None:
    """The run's evaluations as a table: (the run's clock in `unit`, mean, min, max, version) each."""
    table = [{unit: steps, "version": "" if version is None else f"v{version}", "mean return": round(mean, 3),
              "min": round(low, 3), "max": round(high, 3)} for steps, mean, low, high, version in rows]
    create_table_artifact(table, key=EVALUATIONS_KEY, description=f"gymflow run {run_id}: greedy evaluations")
