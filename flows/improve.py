"""The improve loop as a Prefect flow: heatup, then rounds of collect -> learn -> evaluate.

SYNC: round v collects with policy version v on every rollout worker (one shard each), the
learner reads exactly those shards and commits version v + 1. Evaluation of version v runs on
the Dask workers while the learner learns, so it does not stall training.
"""

from __future__ import annotations

import math
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from agents.core import Learner
from flows.progress import ProgressLog
from presets.load import flatten, redacted
from presets.overrides import PresetOverrides, as_dotted
from presets.validate import Experiment, resolve_experiment
from tasks.cluster import dask_client
from tasks.jobs import EvaluationResult
from tasks.learn import create_learner, fill_replay, learn, save_checkpoint
from tasks.models import log_policy_model, read_warm_start
from tasks.plots import PLOTTED_METRICS, plot_learning_curve
from tasks.resume import (
    read_run_record,
    resolve_stored_experiment,
    restore_learner,
    write_run_record,
)
from tasks.rollout import collect_rollouts, evaluate_policy
from tasks.rounds import (
    evaluation_metrics,
    evaluation_round,
    heatup_steps_per_env,
    rollout_round,
    round_metrics,
    storage_location,
)
from tasks.storage import RunLayout, check_storage, open_storage
from tasks.tracking import Tracker, s3_artifact_environment


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

    @property
    def orchestration_share(self) -> float:
        """The share of the training loop's wall-clock not spent stepping envs or learning."""
        return 1.0 - self.work_seconds / self.wall_seconds if self.wall_seconds else 0.0


@flow(name="improve", log_prints=True)
def improve(
    preset: str = "cartpole-ppo",
    overrides: PresetOverrides | None = None,
    warm_start: str | None = None,
    resume: str | None = None,
) -> RunSummary:
    """Train a preset: heatup, then rounds of collect -> learn -> evaluate until the step budget
    or the target return.

    Args:
        preset: A built-in preset name (cartpole-ppo, cartpole-dqn) or a preset YAML path.
        overrides: Preset fields to change, as a form or as dotted keys ({"agent.lr": 0.0003}).
        warm_start: Start from this policy: an MLflow model URI (models:/name@champion) or a
            policy.safetensors path. Empty starts from scratch.
        resume: The id of a run whose flow died: continue it from its last valid checkpoint to
            its original end, in the same MLflow run. Its preset comes from its storage; only
            storage settings (where to find it) are taken from preset and overrides.
    """
    experiment = resolve_experiment(preset, as_dotted(overrides))  # bad input stops here; nothing written
    check_storage(storage_location(experiment.preset))  # a missing bucket or refused credentials stop here
    storage = open_storage(storage_location(experiment.preset))
    record = read_run_record(storage, resume) if resume else None
    if resume:
        experiment = resolve_stored_experiment(storage, resume, experiment)
    config = experiment.preset
    learner = create_learner(experiment, read_warm_start(warm_start, config.tracking.tracking_uri) if warm_start else None)
    position = None
    logger = get_run_logger()
    if resume:
        position, refused = restore_learner(storage, resume, learner, config.distribution.rollout_workers)
        for reason in refused:
            logger.warning("not resuming from a damaged checkpoint: %s", reason)
    run_id = resume or f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    with (
        dask_client(config.distribution) as client,  # an unreachable cluster stops here
        s3_artifact_environment(config.storage.options),
    ):
        tags = {"gymflow.run_id": run_id, "prefect.flow_run_id": str(flow_run.id), "gymflow.preset": config.name}
        tracker = Tracker(config.tracking.tracking_uri, config.tracking.experiment, run_name=run_id, tags=tags,
                          artifact_location=config.tracking.artifact_location,
                          existing_run_id=record["mlflow_run_id"] if record else None)
        summary = RunSummary(run_id, tracker.run_id, storage.url(RunLayout(run_id).prefix))
        logger.info("run %s%s: storage %s, MLflow run %s, Dask dashboard %s", run_id,
                    f" resumed at v{position['version']}" if position else "", summary.storage_url,
                    tracker.run_id, client.dashboard_link)
        succeeded = False
        try:
            if not resume:
                tracker.log_params(flatten(redacted(config.model_dump(mode="json"))))
                storage.write(RunLayout(run_id).preset, _preset_yaml(experiment))
                write_run_record(storage, run_id, {"mlflow_run_id": tracker.run_id, "experiment": config.tracking.experiment,
                                                   "tracking_uri": config.tracking.tracking_uri})
            history = _train(experiment, learner, run_id, client, tracker, summary, logger, position)
            _log_artifacts(experiment, run_id, tracker, summary, history)
            succeeded = True
        finally:
            tracker.finish(succeeded)
    logger.info("run %s done: %s", run_id, _describe(summary))
    create_markdown_artifact(key="improve-summary", markdown=_summary_markdown(config, summary, tracker),
                             description=f"gymflow run {run_id}")
    return summary


def _train(
    experiment: Experiment, learner: Learner, run_id: str, client, tracker: Tracker, summary: RunSummary, logger,
    position: dict[str, Any] | None = None,
) -> list[dict[str, float]]:
    """The improve loop proper, from the start or from `position` (a checkpoint's counters);
    fills `summary` and returns the per-round metrics."""
    config, algorithm, schedule = experiment.preset, experiment.algorithm, experiment.preset.schedule
    timeout_s, location = config.distribution.rollout_timeout_s, storage_location(config)
    resources = config.distribution.rollout_resources
    progress = ProgressLog(logger, schedule.total_env_steps)
    started = time.perf_counter()
    if position is None:
        history: list[dict[str, float]] = []
        position = _position(0, 0, schedule.evaluate_every_env_steps, [None] * config.distribution.rollout_workers)
        if not algorithm.on_policy and schedule.heatup_env_steps:
            specs = rollout_round(config, run_id, None, 1.0, position["resume_from"], heatup_steps_per_env(config))
            shards = collect_rollouts(client, specs, timeout_s, "heatup", resources)
            fill_replay(learner, location, shards)
            position |= {"env_steps": sum(shard.env_steps for shard in shards), "resume_from": [s.key for s in shards]}
            progress.update(position["env_steps"], "heatup done")
        save_checkpoint(location, run_id, 0, learner, position, include_replay=config.storage.checkpoint_replay)
    else:  # resumed: what was logged before the flow died is in MLflow
        history = tracker.metric_rows(PLOTTED_METRICS)
        summary.evaluations = tracker.evaluation_rows()
    version, env_steps = position["version"], position["env_steps"]
    next_evaluation, resume_from = position["next_evaluation"], position["resume_from"]

    evaluation: EvaluationResult | None = None
    while env_steps < schedule.total_env_steps:
        round_started = time.perf_counter()
        exploration = algorithm.exploration(config.agent, env_steps)
        specs = rollout_round(config, run_id, version, exploration, resume_from)
        shards = collect_rollouts(client, specs, timeout_s, f"v{version}", resources)
        scoring = None
        if env_steps >= next_evaluation:  # scores version v on the workers while the learner learns
            next_evaluation += schedule.evaluate_every_env_steps
            scoring = evaluate_policy.submit(client, evaluation_round(config, run_id, version), timeout_s, version, resources)
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
            break

    if not summary.solved:  # the final evaluation, of the last version
        evaluation = evaluate_policy(client, evaluation_round(config, run_id, version), timeout_s, version, resources)
        _record_evaluation(evaluation, env_steps, tracker, summary)
        summary.work_seconds += evaluation.seconds
        summary.solved = _target_reached(schedule.target_return, evaluation)
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
    return history


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


def _log_artifacts(
    experiment: Experiment, run_id: str, tracker: Tracker, summary: RunSummary, history: list[dict[str, float]]
) -> None:
    config = experiment.preset
    layout = RunLayout(run_id)
    storage = open_storage(storage_location(config))
    with tempfile.TemporaryDirectory() as folder:
        preset_file = Path(folder, "preset.yaml")
        preset_file.write_bytes(_preset_yaml(experiment))
        tracker.log_artifact(str(preset_file))
        checkpoint_dir = Path(folder, "checkpoint")
        storage.download(layout.checkpoint(summary.delivered_version), str(checkpoint_dir))
        tracker.log_artifact(str(checkpoint_dir), "checkpoint")
        policy = (checkpoint_dir / "policy.safetensors").read_bytes()
        summary.model_uri = log_policy_model(tracker, policy, _preset_yaml(experiment))
        curve = plot_learning_curve(
            history,
            summary.evaluations,
            str(Path(folder, "learning_curve.png")),
            title=f"{config.name}: {config.agent.algo.upper()} on {config.env.id}",
            target_return=config.schedule.target_return,
        )
        tracker.log_artifact(curve)
    tracker.set_tags({"gymflow.delivered_version": str(summary.delivered_version), "gymflow.solved": str(summary.solved)})


def _preset_yaml(experiment: Experiment) -> bytes:
    return yaml.safe_dump(redacted(experiment.preset.model_dump(mode="json")), sort_keys=False).encode()


def _summary_markdown(config, summary: RunSummary, tracker: Tracker) -> str:
    uri = config.tracking.tracking_uri
    if uri.startswith(("http://", "https://")):
        mlflow_link = f"[{summary.mlflow_run_id}]({uri.rstrip('/')}/#/experiments/{tracker.experiment_id}/runs/{summary.mlflow_run_id})"
    else:
        mlflow_link = f"`{summary.mlflow_run_id}` (browse: `mlflow ui --backend-store-uri {uri}`)"
    rows = [
        ("preset", f"`{config.name}`: {config.agent.algo.upper()} on `{config.env.id}`"),
        ("final evaluation return", f"{summary.final_return:.2f}"),
        ("best evaluation return", f"{summary.best_return:.2f}"),
        ("target reached", "yes" if summary.solved else "no"),
        ("environment steps", f"{summary.env_steps:,}"),
        ("training wall-clock", f"{summary.wall_seconds:.1f} s ({100 * summary.orchestration_share:.0f}% orchestration)"),
        ("versions committed", f"{summary.versions_committed} (delivered v{summary.delivered_version})"),
        ("MLflow run", mlflow_link),
        ("MLflow model", f"`{summary.model_uri}`"),
        ("checkpoints and shards", f"`{summary.storage_url}`"),
    ]
    return "| | |\n|---|---|\n" + "\n".join(f"| {name} | {value} |" for name, value in rows)


def _describe(summary: RunSummary) -> str:
    fields = asdict(summary)
    fields.pop("evaluations")
    fields["orchestration_share"] = round(summary.orchestration_share, 3)
    return ", ".join(f"{key}={value}" for key, value in fields.items())
