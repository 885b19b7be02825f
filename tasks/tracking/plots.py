"""The learning curve a person looks at: returns, losses and throughput against env steps (an
offline run's: against gradient steps)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

_LOSSES = ("train/policy_loss", "train/value_loss", "train/entropy", "train/td_loss", "train/q_mean",
           "train/critic_loss", "train/actor_loss", "train/cloning_loss", "train/advantage_mean",
           "train/cql_penalty")
_LAG = "async/policy_lag_mean"
GRADIENT_STEPS = "time/gradient_steps"  # an offline run's clock (it collects no env steps)
PLOTTED_METRICS = ("rollout/episode_return_mean", "time/env_steps_per_second", _LAG, *_LOSSES, GRADIENT_STEPS)


def plot_learning_curve(
    history: Sequence[Mapping[str, float]],
    evaluations: Sequence[tuple[int, float, float, float, int | None]],
    path: str,
    title: str,
    target_return: float | None = None,
) -> str:
    """Write a PNG to `path`. `history` holds one metrics dict per iteration (with
    'time/env_steps', and an offline run's 'time/gradient_steps'); `evaluations` holds (clock,
    mean, min, max, version) of each evaluation."""
    from matplotlib.figure import Figure  # here, and not pyplot: a figure drawn to a file needs no GUI machinery

    figure = Figure(figsize=(9, 9), layout="constrained")  # laid out as it is drawn: one drawing, not two
    returns_ax, loss_ax, speed_ax = figure.subplots(3, 1, sharex=True, gridspec_kw={"height_ratios": [2.2, 1, 1]})
    offline = any(GRADIENT_STEPS in h for h in history)
    steps = np.array([h.get(GRADIENT_STEPS, np.nan) if offline else h["time/env_steps"] for h in history], float)
    _draw_returns(returns_ax, history, steps, evaluations, target_return)
    returns_ax.set_title(title)
    for key in _LOSSES:
        values = np.array([h.get(key, np.nan) for h in history])
        if np.isfinite(values).any():
            loss_ax.plot(steps, values, lw=1, label=key.split("/", 1)[1])
    loss_ax.set_ylabel("learner")
    if loss_ax.lines:  # an offline or collect-only run may have no learner losses to show
        loss_ax.legend(loc="upper right", fontsize=8)
    loss_ax.grid(alpha=0.3)
    _draw_speed(speed_ax, history, steps)
    speed_ax.set_xlabel("gradient steps (offline: no environment steps)" if offline else "environment steps")
    figure.savefig(path, dpi=110)
    return path


def _draw_returns(axes, history: Sequence[Mapping[str, float]], steps: np.ndarray,
                  evaluations: Sequence[tuple[int, float, float, float, int | None]], target: float | None) -> None:
    train_returns = np.array([h.get("rollout/episode_return_mean", np.nan) for h in history])
    ended = np.isfinite(train_returns)  # async periods can be too short for an episode to end
    axes.plot(steps[ended], train_returns[ended], color="tab:blue", alpha=0.45, lw=1, label="training episodes (mean)")
    if evaluations:
        eval_steps, means, lows, highs = (np.array(column, dtype=float) for column in list(zip(*evaluations))[:4])
        axes.fill_between(eval_steps, lows, highs, color="tab:orange", alpha=0.2, label="evaluation min-max")
        axes.plot(eval_steps, means, "o-", color="tab:orange", lw=2, label="evaluation (greedy, mean)")
    if target is not None:
        axes.axhline(target, color="tab:green", ls="--", lw=1, label=f"target {target:g}")
    axes.set_ylabel("episode return")
    axes.legend(loc="lower right", fontsize=8)
    axes.grid(alpha=0.3)


def _draw_speed(axes, history: Sequence[Mapping[str, float]], steps: np.ndarray) -> None:
    speed = np.array([h.get("time/env_steps_per_second", np.nan) for h in history])
    axes.plot(steps, speed, color="tab:purple", lw=1)
    axes.set_ylabel("env steps / s\n(wall-clock)")
    lag = np.array([h.get(_LAG, np.nan) for h in history])
    if np.isfinite(lag).any():
        lag_ax = axes.twinx()
        lag_ax.plot(steps[np.isfinite(lag)], lag[np.isfinite(lag)], color="tab:gray", lw=1, alpha=0.7)
        lag_ax.set_ylabel("policy lag\n(versions, mean)", color="tab:gray")
    axes.grid(alpha=0.3)
