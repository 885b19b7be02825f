"""gymflow's Prefect events: what a run, a registered model and a sweep did, each event about a
resource of its own (`gymflow.run.RUN_ID`, `gymflow.model.NAME`, `gymflow.sweep.SWEEP_ID`) so
that Prefect automations can react to them (prefect.yaml `triggers:`; docs/deploy.md "Events").
Prefect relates each to the flow run that emitted it. Sending is queued on Prefect's events
thread: a run never waits for it.

    gymflow.run.evaluated        an evaluation: return (mean, low, high), env_steps, version
    gymflow.run.target-reached   the deciding evaluation reached schedule.target_return
    gymflow.run.finished         the run ended and delivered: final_return, solved, env_steps, model_uri
    gymflow.run.failed           the run raised: error (its first line)
    gymflow.run.stopped          stopped from outside (Ctrl-C, SIGTERM, a Prefect cancellation)
    gymflow.model.promoted       a challenger became champion: challenger_return, champion_return, margin
    gymflow.model.kept           the champion stayed: the same payload
    gymflow.model.scored         a monitoring run scored the champion: mean_return, threshold, version, ...
    gymflow.model.degraded       ... and it was below the threshold (with preset and overrides: a retraining's)
    gymflow.sweep.finished       a sweep ended: its best row and best preset
    gymflow.flow-run.refused     a flow run stopped by a gymflow error (a parameter out of bounds, a model
                                 with no champion): the error's one line is the resource's name, which
                                 `prefect deployment run --watch` prints
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from prefect.events import emit_event

PREFIX = "gymflow."


@dataclass(frozen=True)
class RunEvents:
    """The events of one improve run."""

    run_id: str
    preset: str
    mlflow_run_id: str

    @property
    def resource(self) -> dict[str, str]:
        return {"prefect.resource.id": f"gymflow.run.{self.run_id}", "prefect.resource.name": self.run_id,
                "gymflow.preset": self.preset, "gymflow.mlflow_run_id": self.mlflow_run_id}

    def evaluated(self, env_steps: int, version: int, mean: float, low: float, high: float) -> None:
        emit("gymflow.run.evaluated", self.resource,
             {"return": mean, "return_low": low, "return_high": high, "env_steps": env_steps, "version": version})

    def finished(self, payload: dict[str, Any], solved: bool) -> None:
        if solved:
            emit("gymflow.run.target-reached", self.resource, payload)
        emit("gymflow.run.finished", self.resource, payload)

    def failed(self, error: BaseException) -> None:
        if isinstance(error, Exception):
            emit("gymflow.run.failed", self.resource, {"error": _first_line(error)})
        else:  # KeyboardInterrupt, Prefect's TerminationSignal
            emit("gymflow.run.stopped", self.resource, {"how": type(error).__name__})


def model_decided(name: str, promoted: bool, payload: dict[str, Any]) -> None:
    """A retrain's decision about the registered model `name`."""
    emit(f"gymflow.model.{'promoted' if promoted else 'kept'}",
         {"prefect.resource.id": f"gymflow.model.{name}", "prefect.resource.name": name}, payload)


def model_scored(name: str, degraded: bool, payload: dict[str, Any]) -> None:
    """A monitoring run scored the champion of `name`: `scored`, and `degraded` below its threshold."""
    resource = {"prefect.resource.id": f"gymflow.model.{name}", "prefect.resource.name": name}
    emit("gymflow.model.scored", resource, payload)
    if degraded:
        emit("gymflow.model.degraded", resource, payload)


def sweep_finished(sweep_id: str, best: dict[str, Any] | None, best_preset: str | None) -> None:
    emit("gymflow.sweep.finished", {"prefect.resource.id": f"gymflow.sweep.{sweep_id}",
                                    "prefect.resource.name": sweep_id},
         {"best": best, "best_preset": best_preset})


def emit(event: str, resource: dict[str, str], payload: dict[str, Any],
         related: list[dict[str, str]] | None = None) -> None:
    emit_event(event, resource=resource, payload=_json_safe(payload), related=related)


def _json_safe(value: Any) -> Any:
    """NaN and infinities as None: an event's payload is JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(item) for item in value]
    return value


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def flow_run_refused(flow_run_id: str, error: Exception) -> None:
    """A flow run that gymflow stopped says why before its state turns Failed: `--watch` prints each
    event's resource name and stops reading events at the run's final state (its logs reach it only
    where the server streams them, which Prefect's server does not by default)."""
    from prefect.events.worker import EventsWorker

    emit("gymflow.flow-run.refused",
         {"prefect.resource.id": f"gymflow.flow-run.{flow_run_id}", "prefect.resource.name": _first_line(error)},
         {"error": _first_line(error), "type": type(error).__name__},
         related=[{"prefect.resource.id": f"prefect.flow-run.{flow_run_id}", "prefect.resource.role": "flow-run"}])
    EventsWorker.drain_all(timeout=5)  # sent before the final state is proposed
