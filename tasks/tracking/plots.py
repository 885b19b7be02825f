"""The learning curve a person looks at: returns, each learner figure on an axis of its own, and
throughput against env steps (an offline run's: against gradient steps)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

_LOSSES = ("train/policy_loss", "train/value_loss", "train/entropy", "train/td_loss", "train/q_mean",
           "train/critic_loss", "train/actor_loss", "train/cloning_loss", "train/advantage_mean",
           "train/cql_penalty")
_LAG = "async/policy_lag_mean"
SPEED = "time/env_steps_per_second"
GRADIENT_STEPS = "time/gradient_steps"  # an offline run's clock (it collects no env steps)
PLOTTED_METRICS = ("rollout/episode_return_mean", SPEED, _LAG, *_LOSSES, GRADIENT_STEPS)


def plot_learning_curve(
    history: Sequence[Mapping[str, float]],
    evaluations: Sequence[tuple[int, float, float, float, int | None]],
    path: str,
    title: str,
    target_return: float | None = None,
) -> str:
    """Write the learning curve (`learning_curve_figure`) as a PNG to `path`."""
    learning_curve_figure(history, evaluations, title, target_return).savefig(path, dpi=110)
    return path


def learning_curve_figure(history: Sequence[Mapping[str, float]],
                          evaluations: Sequence[tuple[int, float, float, float, int | None]],
                          title: str, target_return: float | None = None) -> Any:
    """The curve as a matplotlib Figure. `history` holds one metrics dict per iteration (with
    'time/env_steps', and an offline run's 'time/gradient_steps'), a metric missing from some;
    `evaluations` holds (clock, mean, min, max, version) of each evaluation. Three rows: returns;
    the learner's figures, each on its own axis (a value loss in the hundreds beside an entropy
    under one); env steps per second."""
    from matplotlib.figure import Figure  # here, and not pyplot: a figure drawn to a file needs no GUI machinery

    figure = Figure(figsize=(10, 9.5), layout="constrained")  # laid out as it is drawn: one drawing, not two
    returns_row, learner_row, speed_row = figure.subfigures(3, 1, height_ratios=[2.2, 1.1, 1])
    offline = any(GRADIENT_STEPS in h for h in history)
    steps = np.array([h.get(GRADIENT_STEPS, np.nan) if offline else h["time/env_steps"] for h in history], float)
    clock = "gradient steps (offline: no environment steps)" if offline else "environment steps"
    returns_ax = returns_row.subplots()
    _draw_returns(returns_ax, history, steps, evaluations, target_return)
    returns_ax.set_title(title)
    _draw_learner(learner_row, history, steps)
    speed_ax = speed_row.subplots()
    _draw_speed(speed_ax, history, steps)
    speed_ax.set_xlabel(clock)
    ends = [float(np.nanmax(steps))] if np.isfinite(steps).any() else []
    ends += [float(evaluations[-1][0])] if evaluations else []
    for axes in figure.get_axes():  # one clock on every row
        if axes.axison and ends:
            axes.set_xlim(0, max(ends) or 1.0)
    return figure


def logged(history: Sequence[Mapping[str, float]], steps: np.ndarray, key: str) -> tuple[np.ndarray, np.ndarray]:
    """The steps where `key` was logged, and its values there: a line through them has no gaps."""
    values = np.array([h.get(key, np.nan) for h in history], float)
    kept = np.isfinite(values) & np.isfinite(steps)
    return steps[kept], values[kept]


def _draw_returns(axes, history: Sequence[Mapping[str, float]], steps: np.ndarray,
                  evaluations: Sequence[tuple[int, float, float, float, int | None]], target: float | None) -> None:
    train_steps, train_returns = logged(history, steps, "rollout/episode_return_mean")  # a short period ends none
    axes.plot(train_steps, train_returns, color="tab:blue", alpha=0.45, lw=1, label="training episodes (mean)")
    if evaluations:
        eval_steps, means, lows, highs = (np.array(column, dtype=float) for column in list(zip(*evaluations))[:4])
        axes.fill_between(eval_steps, lows, highs, color="tab:orange", alpha=0.2, label="evaluation min-max")
        axes.plot(eval_steps, means, "o-", color="tab:orange", lw=2, label="evaluation (greedy, mean)")
    if target is not None:
        axes.axhline(target, color="tab:green", ls="--", lw=1, label=f"target {target:g}")
    axes.set_ylabel("episode return")
    axes.legend(loc="lower right", fontsize=8)
    axes.grid(alpha=0.3)


def _draw_learner(row, history: Sequence[Mapping[str, float]], steps: np.ndarray) -> None:
    """One small axis per learner figure the run logged; a run without any (collect-only) says so."""
    series = [(key, *logged(history, steps, key)) for key in _LOSSES]
    series = [(key, x, y) for key, x, y in series if len(y)]
    if not series:
        axes = row.subplots()
        axes.text(0.5, 0.5, "no learner figures (nothing was learnt)", ha="center", va="center",
                  transform=axes.transAxes, color="gray")
        axes.set_axis_off()
        return
    for axes, (key, x, y) in zip(np.atleast_1d(row.subplots(1, len(series))), series):
        axes.plot(x, y, lw=1, marker="." if len(y) < 30 else None, color="tab:red")
        axes.set_title(key.split("/", 1)[1], fontsize=9)
        axes.tick_params(labelsize=7)
        axes.grid(alpha=0.3)


def _draw_speed(axes, history: Sequence[Mapping[str, float]], steps: np.ndarray) -> None:
    x, speed = logged(history, steps, SPEED)
    axes.plot(x, speed, color="tab:purple", lw=1, marker="." if len(speed) < 30 else None)
    axes.set_ylabel("env steps / s\n(wall-clock)")
    lag_steps, lag = logged(history, steps, _LAG)
    if len(lag):
        lag_ax = axes.twinx()
        lag_ax.plot(lag_steps, lag, color="tab:gray", lw=1, alpha=0.7)
        lag_ax.set_ylabel("policy lag\n(versions, mean)", color="tab:gray")
    axes.grid(alpha=0.3)
