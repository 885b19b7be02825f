"""The learning curve a person looks at: returns, losses and throughput against env steps."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

_LOSSES = ("train/policy_loss", "train/value_loss", "train/entropy", "train/td_loss", "train/q_mean",
           "train/critic_loss", "train/actor_loss")
_LAG = "async/policy_lag_mean"
PLOTTED_METRICS = ("rollout/episode_return_mean", "time/env_steps_per_second", _LAG, *_LOSSES)


def plot_learning_curve(
    history: Sequence[Mapping[str, float]],
    evaluations: Sequence[tuple[int, float, float, float, int | None]],
    path: str,
    title: str,
    target_return: float | None = None,
) -> str:
    """Write a PNG to `path`. `history` holds one metrics dict per iteration (with
    'time/env_steps'); `evaluations` holds (env_steps, mean, min, max, version) of each evaluation."""
    figure, (returns_ax, loss_ax, speed_ax) = _pyplot().subplots(
        3, 1, figsize=(9, 9), sharex=True, gridspec_kw={"height_ratios": [2.2, 1, 1]}
    )
    steps = np.array([h["time/env_steps"] for h in history], dtype=float)

    train_returns = np.array([h.get("rollout/episode_return_mean", np.nan) for h in history])
    ended = np.isfinite(train_returns)  # async periods can be too short for an episode to end
    returns_ax.plot(steps[ended], train_returns[ended], color="tab:blue", alpha=0.45, lw=1,
                    label="training episodes (mean)")
    if evaluations:
        eval_steps, means, lows, highs = (np.array(column, dtype=float) for column in list(zip(*evaluations))[:4])
        returns_ax.fill_between(eval_steps, lows, highs, color="tab:orange", alpha=0.2, label="evaluation min-max")
        returns_ax.plot(eval_steps, means, "o-", color="tab:orange", lw=2, label="evaluation (greedy, mean)")
    if target_return is not None:
        returns_ax.axhline(target_return, color="tab:green", ls="--", lw=1, label=f"target {target_return:g}")
    returns_ax.set_ylabel("episode return")
    returns_ax.legend(loc="lower right", fontsize=8)
    returns_ax.grid(alpha=0.3)
    returns_ax.set_title(title)

    for key in _LOSSES:
        values = np.array([h.get(key, np.nan) for h in history])
        if np.isfinite(values).any():
            loss_ax.plot(steps, values, lw=1, label=key.split("/", 1)[1])
    loss_ax.set_ylabel("learner")
    loss_ax.legend(loc="upper right", fontsize=8)
    loss_ax.grid(alpha=0.3)

    speed = np.array([h.get("time/env_steps_per_second", np.nan) for h in history])
    speed_ax.plot(steps, speed, color="tab:purple", lw=1)
    speed_ax.set_ylabel("env steps / s\n(wall-clock)")
    lag = np.array([h.get(_LAG, np.nan) for h in history])
    if np.isfinite(lag).any():
        lag_ax = speed_ax.twinx()
        lag_ax.plot(steps[np.isfinite(lag)], lag[np.isfinite(lag)], color="tab:gray", lw=1, alpha=0.7)
        lag_ax.set_ylabel("policy lag\n(versions, mean)", color="tab:gray")
    speed_ax.set_xlabel("environment steps")
    speed_ax.grid(alpha=0.3)

    figure.tight_layout()
    figure.savefig(path, dpi=110)
    _pyplot().close(figure)
    return path


def _pyplot():
    """matplotlib's pyplot, drawing to files: imported when the first curve is drawn (at the end of
    a run), not among the imports that stand between the command and its first training round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
