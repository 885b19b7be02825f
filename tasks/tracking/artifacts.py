"""What the Prefect UI shows of a run besides its task runs: a progress bar that moves as training
advances, the table of its evaluations, and the summary (written by tasks/training/delivery.py)."""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Sequence
from functools import partial

from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact

from gymflow.outage import Outage

PROGRESS_KEY, EVALUATIONS_KEY = "improve-progress", "improve-evaluations"
_logger = logging.getLogger(__name__)


class ProgressArtifact:
    """The run's progress artifact: percent of the budget (env steps; offline: gradient steps),
    and the status line as its description; sent to the API at most every `every_s` seconds (each
    update is a request: ~15 ms of the API's on these machines, which the loop does not wait for;
    one still out when the next is due is passed over). The last update, at the budget's end, is
    sent once the one before it is, and waited for. An update still out when the process ends is
    dropped, not waited for (its API may be gone: a Ctrl-C stops the temporary one). An update the
    API refuses (a server whose database is failing over answers 500) is passed over, said once:
    the bar is not worth a run."""

    def __init__(self, run_id: str, every_s: float = 2.0, prefect: Outage | None = None):
        """`prefect`: the API's outage (tasks/tracking/prefect_watch.py): no update is sent while it lasts."""
        self.run_id, self.every_s, self.prefect = run_id, every_s, prefect
        self.artifact_id = create_progress_artifact(0.0, key=PROGRESS_KEY, description=f"gymflow run {run_id}")
        self._sent = 0.0
        self._out: threading.Thread | None = None
        self._failing = False

    def update(self, done: int, total: int, unit: str, status: str) -> None:
        if self.prefect is not None and self.prefect.going_on:  # each try would wait out Prefect's retries
            return
        now = time.monotonic()
        final = done >= total
        if not final and (now - self._sent < self.every_s or (self._out is not None and self._out.is_alive())):
            return
        self._sent = now
        description = f"gymflow run {self.run_id}: {done:,}/{total:,} {unit}, {status}"
        send = partial(contextvars.copy_context().run, self._send, 100.0 * min(done / total, 1.0),  # to the API
                       description)  # the flow run talks to
        if final:
            if self._out is not None:
                self._out.join()
            send()
            return
        self._out = threading.Thread(target=send, name="progress-artifact", daemon=True)
        self._out.start()


    def finish(self, done: int, total: int, unit: str, status: str) -> None:
        """At 100% with the outcome, whatever share of the budget the run spent (a target reached
        early), once the update still out is sent."""
        if self.prefect is not None and self.prefect.going_on:
            return
        if self._out is not None:
            self._out.join()
        early = "" if done >= total else " (stopped early)"
        contextvars.copy_context().run(self._send, 100.0, f"gymflow run {self.run_id}: {done:,}/{total:,} {unit}"
                                                          f"{early}, {status}")

    def _send(self, progress: float, description: str) -> None:
        try:
            update_progress_artifact(self.artifact_id, progress, description=description)
        except Exception as error:  # the API's answer (an HTTP error) or none (a refused connection)
            if not self._failing:
                _logger.warning("the run's progress artifact was not updated (%s); the next update tries again",
                                " ".join(str(error).split())[:160])
            self._failing = True
        else:
            self._failing = False


def publish_evaluations(run_id: str, rows: Sequence[tuple[int, float, float, float, int | None]],
                        unit: str = "env steps") -> None:
    """The run's evaluations as a table: (the run's clock in `unit`, mean, min, max, version) each."""
    table = [{unit: steps, "version": "" if version is None else f"v{version}", "mean return": round(mean, 3),
              "min": round(low, 3), "max": round(high, 3)} for steps, mean, low, high, version in rows]
    create_table_artifact(table, key=EVALUATIONS_KEY, description=f"gymflow run {run_id}: greedy evaluations")
