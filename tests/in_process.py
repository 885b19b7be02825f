"""The improve loop in-process, for the tests: its jobs run in this process (gymflow.testing's
InProcessHosts), on a local storage folder, with no flow run, Dask or MLflow. Its heatup and
evaluations are Prefect tasks: a test that runs the loop uses the `prefect_api` fixture."""

from __future__ import annotations

import logging

from gymflow.presets.validate import resolve_experiment
from gymflow.tasks.storage.objects import open_storage, storage_location
from gymflow.tasks.training.evaluation import Scored
from gymflow.tasks.training.learning import create_learner
from gymflow.tasks.training.loop import StepReport
from gymflow.tasks.training.run import PreparedRun, first_state, improve_loop
from gymflow.tasks.training.state import LoopState
from gymflow.testing.hosts import InProcessHosts

LOGGER = logging.getLogger("test-loop")


class Recording:
    """An observer that keeps what the loop reports."""

    def __init__(self) -> None:
        self.reports: list[StepReport] = []
        self.evaluations: list[Scored] = []
        self.films: list[Scored] = []

    def stepped(self, report: StepReport) -> None:
        self.reports.append(report)

    def committed(self, state: LoopState, timings: dict[str, float]) -> None:
        pass

    def settle(self) -> None:
        pass

    def evaluated(self, scored: Scored, waited: bool = False) -> None:
        self.evaluations.append(scored)

    def filmed(self, scored: Scored) -> None:
        self.films.append(scored)


def prepared(tmp_path, preset: str, overrides: dict, run_id: str = "run") -> PreparedRun:
    experiment = resolve_experiment(preset, {"storage.root": str(tmp_path / "store"), **overrides})
    storage = open_storage(storage_location(experiment.preset.storage))
    return PreparedRun(experiment, run_id, storage, create_learner(experiment))


def train_in_process(run: PreparedRun, steps: int | None = None) -> tuple[LoopState, Recording, Scored | None]:
    """The flow's train stage, in-process: from the first state until the stop rule (or for
    `steps` steps, as if the flow died there)."""
    observer, hosts = Recording(), InProcessHosts()
    with improve_loop(run, hosts, observer, LOGGER) as loop:
        state = first_state(run, hosts, loop, LOGGER)
        while not loop.stopped(state) and (steps is None or len(observer.reports) < steps):
            state = loop.step(state)
        if steps is not None:
            return state, observer, None
        state, deciding, _ = loop.finish(state)
    return state, observer, deciding


