"""The learning curve a person reads (tasks/tracking/plots.py): every logged point of each series on
it, the learner's figures each on an axis of its own; and the run's recorder keeps the throughput it
logs at each commit for it."""

from __future__ import annotations

import numpy as np
import pytest

from gymflow.tasks.tracking.plots import learning_curve_figure
from gymflow.tasks.training.run import first_state, improve_loop
from gymflow.tasks.training.state import Budget
from gymflow.testing.hosts import InProcessHosts
from tests.in_process import LOGGER, prepared


def _line_of(figure, ylabel: str):
    (axes,) = [axes for axes in figure.get_axes() if axes.get_ylabel().startswith(ylabel)]
    (line,) = axes.get_lines()
    return line


def _history(rows: int) -> list[dict[str, float]]:
    """Rows as MLflow gives a resumed run's back: throughput logged at commits, not with every row."""
    history = []
    for row in range(rows):
        point = {"time/env_steps": 128.0 * (row + 1), "train/value_loss": 300.0 / (row + 1),
                 "train/entropy": 0.69 - 0.01 * row, "train/policy_loss": (-1) ** row * 0.01}
        if row % 2:
            point["time/env_steps_per_second"] = 1000.0 + row
        history.append(point)
    return history


def test_every_logged_throughput_point_is_drawn_as_one_line_and_each_loss_has_its_own_axis():
    figure = learning_curve_figure(_history(22), [(1280, 5.0, 1.0, 9.0, 10)], "curve")
    speed = _line_of(figure, "env steps / s")
    x, y = (np.asarray(values, float) for values in speed.get_data())
    assert len(y) == 11 and np.isfinite(y).all() and list(x) == [128.0 * (row + 1) for row in range(1, 22, 2)]
    learner = {axes.get_title(): axes for axes in figure.get_axes() if axes.get_title() in
               ("value_loss", "entropy", "policy_loss")}
    assert sorted(learner) == ["entropy", "policy_loss", "value_loss"]
    low, high = learner["entropy"].get_ylim()
    assert high - low < 1.0  # the entropy's axis is its own, not the value loss's hundreds


@pytest.mark.usefixtures("prefect_api")
def test_the_recorder_keeps_each_round_s_throughput_for_the_curve(tiny_budget, tmp_path):
    from gymflow.tasks.tracking.progress import ProgressLog
    from gymflow.tasks.tracking.tracker import Tracker
    from gymflow.tasks.training.summary import RunRecorder

    run = prepared(tmp_path, "cartpole-ppo", tiny_budget)
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "loop", "run", {})
    budget = Budget.of(run.preset)
    recorder, hosts = RunRecorder(tracker, ProgressLog(LOGGER, budget.total), budget), InProcessHosts()
    with improve_loop(run, hosts, recorder, LOGGER) as loop:
        state = first_state(run, hosts, loop, LOGGER)
        while not loop.stopped(state):
            state = loop.step(state)
    tracker.finish("FINISHED")
    assert [row["time/env_steps"] for row in recorder.history] == [128, 256, 384, 512, 640]
    assert all(row["time/env_steps_per_second"] > 0 for row in recorder.history)
    figure = learning_curve_figure(recorder.history, [], "curve")
    assert len(_line_of(figure, "env steps / s").get_xdata()) == 5
