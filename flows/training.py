"""The improve loop's two training modes, each from a fresh start or a checkpoint's counters.

SYNC: round v collects with policy version v on every rollout worker (one shard each), the
learner reads exactly those shards and commits version v + 1. Evaluation of version v runs on
the Dask workers while the learner learns, so it does not stall training.

ASYNC (off-policy agents): rollout workers collect continuously with the newest committed
version; the learner inserts shards as they land, trains at a fixed ratio of samples to inserts
and commits versions as it goes (tasks/stream.py, tasks/async_learn.py).
"""

from __future__ import annotations

import math
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from agents.core import Learner
from flows.progress import ProgressLog
from presets.validate import Experiment
from tasks.async_learn import AsyncTraining, learn_async
from tasks.hosts import HostPool
from tasks.jobs import EvaluationResult
from tasks.learn import fill_replay, learn, save_checkpoint, train_stretch
from tasks.plots import PLOTTED_METRICS
from tasks.rollout import collect_heatup, collect_rollouts, evaluate_policy, evaluate_version
from tasks.rounds import (
    evaluation_metrics,
    evaluation_round,
    heatup_steps_per_env,
    rollout_round,
    round_metrics,
    storage_location,
    stream_metrics,
)
from tasks.storage import open_storage
from tasks.stream import Ledger, RolloutStream, write_ledger
from tasks.tracking import Tracker


@dataclass
class RunSummary:
    run_id: str
    mlflow_run_id: str
    storage_url: str
    env_steps: int = 0
    versions_committed: int = 0
    delivered_version: int = 0  # the version the last evaluation scored, logged as the model
    model_uri: str = ""  # the delivered policy as an MLflow model (runs:/<id>/policy)
    final_return: float | None = None
    best_return: float | None = None
    solved: bool = False
    wall_seconds: float = 0.0
    work_seconds: float = 0.0  # stepping envs with the policy, learning, evaluating (critical path)
    evaluations: list[tuple[int, float, float, float]] = field(default_factory=list)  # (env steps, mean, min, max)
    rollout_processes: set[str] = field(default_factory=set)  # host:pid of every process that collected
    shards_inserted: int = 0  # async: shards inserted into replay
    shards_dropped: int = 0  # async: shards dropped by the policy-lag bound
    shards_unused: int = 0  # async: shards that landed after the stop
    policy_lag_mean: float = 0.0  # async: learner version minus the shard's, over every landed shard
    policy_lag_max: int = 0

    @property
    def orchestration_share(self) -> float:
        """The share of the training loop's wall-clock not spent stepping envs or learning."""
        return 1.0 - self.work_seconds / self.wall_seconds if self.wall_seconds else 0.0


def train_sync(
    experiment: Experiment, learner: Learner, run_id: str, hosts: HostPool, tracker: Tracker, summary: RunSummary, logger,
    position: dict[str, Any] | None = None,
) -> list[dict[str, float]]:
    """SYNC: rounds of collect -> learn, from the start or from `position` (a checkpoint's
    counters); fills `summary` and returns the per-round metrics. Rounds run in `train` task
    stretches of a few seconds each."""
    config, algorithm, schedule = experiment.preset, experiment.algorithm, experiment.preset.schedule
    location = storage_location(config)
    progress = ProgressLog(logger, schedule.total_env_steps)
    started = time.perf_counter()
    if position is None:
        history: list[dict[str, float]] = []
        position = _position(0, 0, schedule.evaluate_every_env_steps, [None] * config.distribution.rollout_workers)
        if not algorithm.on_policy and schedule.heatup_env_steps:
            position |= _heatup(experiment, learner, run_id, hosts, progress)
        save_checkpoint(location, run_id, 0, learner, position, include_replay=config.storage.checkpoint_replay)
    else:  # resumed: what was logged before the flow died is in MLflow
        history = tracker.metric_rows(PLOTTED_METRICS)
        summary.evaluations = tracker.evaluation_rows()
    version, env_steps = position["version"], position["env_steps"]
    next_evaluation, resume_from = position["next_evaluation"], position["resume_from"]
    evaluation: EvaluationResult | None = None

    def one_round(evaluations: ThreadPoolExecutor) -> bool:
        """Collect with version v on every worker, learn, commit v + 1; True when training is over."""
        nonlocal version, env_steps, next_evaluation, resume_from, evaluation
        round_started = time.perf_counter()
        exploration = algorithm.exploration(config.agent, env_steps)
        specs = rollout_round(config, run_id, version, exploration, resume_from)
        shards = collect_rollouts(hosts, specs, logger)
        scoring = None
        if env_steps >= next_evaluation:  # scores version v on the workers while the learner learns
            next_evaluation += schedule.evaluate_every_env_steps
            scoring = evaluations.submit(evaluate_version, hosts, evaluation_round(config, run_id, version), version, logger)
        steps_after = env_steps + sum(shard.env_steps for shard in shards)
        learned = learn(
            learner, location, run_id, version, shards,
            progress=min(env_steps / schedule.total_env_steps, 1.0),
            counters=_position(version + 1, steps_after, next_evaluation, [shard.key for shard in shards]),
            include_replay=config.storage.checkpoint_replay,
        )
        if scoring is not None:
            evaluation = scoring.result()
            _record_evaluation(evaluation, env_steps, tracker, summary)
        metrics = round_metrics(shards, learned.metrics, learned.learn_seconds, exploration, steps_after, learned.version,
                                time.perf_counter() - round_started)
        tracker.log_metrics(metrics, step=steps_after)
        history.append(metrics)
        summary.work_seconds += metrics["time/collect_seconds"] + max(
            learned.learn_seconds, evaluation.seconds if scoring is not None else 0.0
        )
        summary.rollout_processes.update(shard.collected_by for shard in shards)
        version, env_steps, resume_from = learned.version, steps_after, [shard.key for shard in shards]
        progress.update(env_steps, _status(version, metrics, summary))
        if _target_reached(schedule.target_return, evaluation):
            summary.solved = True
        return summary.solved or env_steps >= schedule.total_env_steps

    with ThreadPoolExecutor(1, thread_name_prefix="evaluation") as evaluations:
        while not summary.solved and env_steps < schedule.total_env_steps:
            train_stretch(partial(one_round, evaluations), f"v{version}")

    _finish(experiment, hosts, run_id, version, env_steps, evaluation, started, tracker, summary, progress)
    return history


def train_async(
    experiment: Experiment, learner: Learner, run_id: str, hosts: HostPool, tracker: Tracker, summary: RunSummary, logger,
    position: dict[str, Any] | None = None,
) -> list[dict[str, float]]:
    """ASYNC: rollout workers keep collecting while the learner inserts, trains and commits a
    version every `commit_every_train_steps` (tasks/async_learn.py); evaluation runs beside them.
    Stops at the step budget or the target return with every chunk landed and accounted for in
    the run's ledger.json. Commits run in `train` task stretches of a few seconds each. Returns
    one metrics dict per committed version."""
    config, algorithm, schedule = experiment.preset, experiment.algorithm, experiment.preset.schedule
    location, workers = storage_location(config), config.distribution.rollout_workers
    progress = ProgressLog(logger, schedule.total_env_steps)
    started = time.perf_counter()
    if position is None:
        history: list[dict[str, float]] = []
        position = {"version": 0, "env_steps": 0, "next_evaluation": schedule.evaluate_every_env_steps,
                    "resume_from": [None] * workers, "next_chunk": [0] * workers, "ledger": None}
        if schedule.heatup_env_steps:
            position |= _heatup(experiment, learner, run_id, hosts, progress)
        save_checkpoint(location, run_id, 0, learner, position, include_replay=config.storage.checkpoint_replay)
    else:  # resumed: what was logged before the flow died is in MLflow
        history = tracker.metric_rows(PLOTTED_METRICS)
        summary.evaluations = tracker.evaluation_rows()
    stream = RolloutStream(hosts, config, run_id, location, position["next_chunk"], position["resume_from"])
    stream.submitted_steps = position["env_steps"]
    training = AsyncTraining(
        learner, stream, Ledger.from_dict(position["ledger"]), location, run_id, config.samples_per_insert,
        config.distribution.max_policy_lag, config.distribution.commit_every_train_steps, schedule.total_env_steps,
        exploration=lambda env_steps: algorithm.exploration(config.agent, env_steps),
        include_replay=config.storage.checkpoint_replay, env_steps=position["env_steps"],
        next_evaluation=position["next_evaluation"],
    )
    version = position["version"]
    evaluation: EvaluationResult | None = None
    scoring: tuple[Future, int] | None = None  # (the evaluation's future, env steps when it began)
    recent_returns: deque[float] = deque(maxlen=20)  # for the progress line

    def one_commit(evaluations: ThreadPoolExecutor) -> bool:
        """Learn until the next commit, checking on the evaluation beside it; True when training is over."""
        nonlocal version, evaluation, scoring
        if scoring is None and training.env_steps >= training.next_evaluation:
            training.next_evaluation += schedule.evaluate_every_env_steps
            future = evaluations.submit(evaluate_version, hosts, evaluation_round(config, run_id, version), version, logger)
            scoring = (future, training.env_steps)
        period_started = time.perf_counter()
        learned = learn_async(training, version)
        metrics = learned.metrics | stream_metrics(learned.landed, training.env_steps, learned.version,
                                                   time.perf_counter() - period_started)
        tracker.log_metrics(metrics, step=training.env_steps)
        history.append(metrics)
        summary.work_seconds += learned.learn_seconds + learned.waiting_seconds
        summary.rollout_processes.update(shard.collected_by for shard in learned.landed)
        version = learned.version
        recent_returns.extend(r for shard in learned.landed for r in shard.episode_returns)
        recent = {"rollout/episode_return_mean": sum(recent_returns) / len(recent_returns)} if recent_returns else {}
        progress.update(training.env_steps, _status(version, recent, summary))
        if scoring is not None and scoring[0].done():
            evaluation = scoring[0].result()
            _record_evaluation(evaluation, scoring[1], tracker, summary)
            scoring = None
            summary.solved = _target_reached(schedule.target_return, evaluation)
        return summary.solved or training.exhausted

    with ThreadPoolExecutor(1, thread_name_prefix="evaluation") as evaluations:
        try:
            while not summary.solved and not training.exhausted:
                train_stretch(partial(one_commit, evaluations), f"v{version}")
        except BaseException:
            stream.cancel()
            raise
        late = stream.stop()  # chunks that land after the stop are recorded, never inserted
        training.ledger.unused += [shard.key for shard in late]
        training.env_steps += sum(shard.env_steps for shard in late)
        write_ledger(open_storage(location), run_id, training.ledger)
        if scoring is not None:  # an evaluation still running at the budget's end: record it
            evaluation = scoring[0].result()
            _record_evaluation(evaluation, scoring[1], tracker, summary)
            summary.solved = _target_reached(schedule.target_return, evaluation) and evaluation.version == version
    summary.shards_inserted, summary.shards_dropped = len(training.ledger.inserted), len(training.ledger.dropped)
    summary.shards_unused = len(training.ledger.unused)
    lags = list(training.ledger.lags.values())
    summary.policy_lag_mean, summary.policy_lag_max = (sum(lags) / len(lags), max(lags)) if lags else (0.0, 0)
    _finish(experiment, hosts, run_id, version, training.env_steps, evaluation, started, tracker, summary, progress)
    return history


def _heatup(experiment: Experiment, learner: Learner, run_id: str, hosts: HostPool, progress: ProgressLog) -> dict[str, Any]:
    """Fill replay with a uniform random policy, one shard a worker; no learning. Returns the
    counters it moves: env steps and the shards the workers' envs continue from."""
    config = experiment.preset
    specs = rollout_round(config, run_id, None, 1.0, [None] * config.distribution.rollout_workers, heatup_steps_per_env(config))
    shards = collect_heatup(hosts, specs)
    fill_replay(learner, storage_location(config), shards)
    env_steps = sum(shard.env_steps for shard in shards)
    progress.update(env_steps, "heatup done")
    return {"env_steps": env_steps, "resume_from": [shard.key for shard in shards]}


def _finish(
    experiment: Experiment, hosts: HostPool, run_id: str, version: int, env_steps: int, evaluation: EvaluationResult | None,
    started: float, tracker: Tracker, summary: RunSummary, progress: ProgressLog,
) -> None:
    """Evaluate the last version unless the target was reached, and fill in the summary."""
    config = experiment.preset
    if not summary.solved:  # the final evaluation, of the last version
        evaluation = evaluate_policy(hosts, evaluation_round(config, run_id, version), version)
        _record_evaluation(evaluation, env_steps, tracker, summary)
        summary.work_seconds += evaluation.seconds
        summary.solved = _target_reached(config.schedule.target_return, evaluation)
    assert evaluation is not None
    summary.wall_seconds = time.perf_counter() - started
    summary.env_steps, summary.versions_committed = env_steps, version + 1
    summary.delivered_version = evaluation.version
    progress.update(env_steps, f"done: eval {summary.final_return:.1f}", force=True)
    tracker.log_metrics(
        {
            "summary/wall_seconds": summary.wall_seconds,
            "summary/orchestration_share": summary.orchestration_share,
            "summary/final_return": summary.final_return,
            "summary/best_return": summary.best_return,
        },
        step=env_steps,
    )


def _position(version: int, env_steps: int, next_evaluation: int, resume_from: list[str | None]) -> dict[str, Any]:
    """Where training stands after committing `version`: stored in its checkpoint to resume from."""
    return {"version": version, "env_steps": env_steps, "next_evaluation": next_evaluation, "resume_from": resume_from}


def _status(version: int, metrics: dict[str, float], summary: RunSummary) -> str:
    status = f"v{version} return {metrics.get('rollout/episode_return_mean', float('nan')):.1f}"
    return status if summary.final_return is None else f"{status} eval {summary.final_return:.1f}"


def _record_evaluation(evaluation: EvaluationResult, env_steps: int, tracker: Tracker, summary: RunSummary) -> None:
    tracker.log_metrics(evaluation_metrics(evaluation), step=env_steps)
    summary.final_return = evaluation.mean_return
    summary.best_return = max(evaluation.mean_return, summary.best_return if summary.best_return is not None else -math.inf)
    summary.evaluations.append((env_steps, evaluation.mean_return, min(evaluation.returns), max(evaluation.returns)))


def _target_reached(target: float | None, evaluation: EvaluationResult | None) -> bool:
    return target is not None and evaluation is not None and evaluation.mean_return >= target


