"""Aggregates over seeds, as Agarwal et al. 2021 ("Deep RL at the Edge of the Statistical
Precipice", the rliable library) compute them: the interquartile mean (the mean of the middle
50% of runs, robust to one lucky or broken seed) with a 95% stratified bootstrap confidence
interval, of final returns and of the area under the learning curve.

Scores are an array of shape (runs, tasks); a sweep has one task (its preset's env), so
stratifying by task resamples the seeds of that task. The bootstrap's generator is seeded: the
same scores give the same interval, and a restarted sweep the same table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BOOTSTRAP_RESAMPLES = 2_000
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its confidence interval."""

    value: float
    low: float
    high: float


def interquartile_mean(scores: np.ndarray) -> float:
    """The mean of the runs between the 25th and 75th percentiles, over all tasks together."""
    return float(_trimmed_means(np.asarray(scores, dtype=np.float64).reshape(1, -1))[0])


def iqm_with_interval(scores: np.ndarray, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> Estimate:
    """IQM of `scores` (runs x tasks, or runs) and its stratified bootstrap 95% interval: each
    resample draws, task by task, as many runs as the task has, with replacement."""
    scores = np.asarray(scores, dtype=np.float64)
    scores = scores[:, None] if scores.ndim == 1 else scores
    runs, tasks = scores.shape
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, runs, size=(resamples, runs, tasks))
    resampled = np.take_along_axis(np.broadcast_to(scores, (resamples, runs, tasks)), picks, axis=1)
    estimates = _trimmed_means(resampled.reshape(resamples, -1))
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(estimates, [tail, 100 - tail])
    return Estimate(interquartile_mean(scores), float(low), float(high))


def _trimmed_means(rows: np.ndarray) -> np.ndarray:
    """Each row's mean without its lowest and highest quarter (as many values cut at each end:
    a quarter of the row, rounded down; scipy.stats.trim_mean's with proportiontocut=0.25)."""
    count = rows.shape[1]
    cut = int(0.25 * count)
    return np.sort(rows, axis=1)[:, cut:count - cut].mean(axis=1)


def area_under_curve(env_steps: Sequence[int], returns: Sequence[float], total_env_steps: int) -> float:
    """The learning curve's area per env step: the mean evaluation return over the run, by the
    trapezoid rule between evaluations, the first value held back to step 0. A configuration that
    learns sooner scores higher than one that gets to the same return late."""
    if not returns:
        return float("nan")
    steps = np.asarray(env_steps, dtype=np.float64)
    values = np.asarray(returns, dtype=np.float64)
    if steps[0] > 0:
        steps, values = np.concatenate([[0.0], steps]), np.concatenate([[values[0]], values])
    span = max(float(steps[-1]), float(total_env_steps), 1.0)
    area = float(np.trapezoid(values, steps)) + values[-1] * (span - steps[-1])  # the last value held to the end
    return area / span


def curve_band(curves: Sequence[tuple[Sequence[int], Sequence[float]]], points: int = 50
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Learning curves of several seeds on one grid of env steps (each held between its
    evaluations): the grid, the mean, and a 95% interval of the mean (normal approximation;
    the mean itself where there is one seed)."""
    end = max(steps[-1] for steps, _ in curves if len(steps))
    grid = np.linspace(0, end, points)
    values = np.stack([np.interp(grid, steps, returns) for steps, returns in curves if len(steps)])
    mean = values.mean(axis=0)
    if len(values) < 2:
        return grid, mean, mean, mean
    half = 1.96 * values.std(axis=0, ddof=1) / np.sqrt(len(values))
    return grid, mean, mean - half, mean + half
