"""The improve loop as a Prefect flow: validate, heatup, train (SYNC or ASYNC, flows/training.py)
with evaluation beside it, then deliver the policy, its learning curve and a summary.
"""

from __future__ import annotations

import tempfile
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import yaml
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from flows.training import RunSummary, train_async, train_sync
from presets.load import flatten, redacted
from presets.overrides import PresetOverrides, as_dotted
from presets.validate import Experiment, resolve_experiment
from tasks.cluster import dask_client, job_hosts
from tasks.learn import create_learner
from tasks.models import log_policy_model, read_warm_start
from tasks.plots import plot_learning_curve
from tasks.resume import (
    read_run_record,
    resolve_stored_experiment,
    restore_learner,
    write_run_record,
)
from tasks.rounds import (
    storage_location,
)
from tasks.storage import RunLayout, check_storage, open_storage
from tasks.tracking import Tracker, s3_artifact_environment


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
        preset: A built-in preset name (cartpole-ppo, cartpole-dqn, cartpole-dqn-async,
            pendulum-sac) or a preset YAML path.
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
        job_hosts(client, config.distribution) as hosts,
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
            train = train_async if config.distribution.mode == "async" else train_sync
            hosts.wait_started()  # the workers' imports are start-up, not training
            history = train(experiment, learner, run_id, hosts, tracker, summary, logger, position)
            _log_artifacts(experiment, run_id, tracker, summary, history)
            succeeded = True
        finally:
            tracker.finish(succeeded)
    logger.info("run %s done: %s", run_id, _describe(summary))
    create_markdown_artifact(key="improve-summary", markdown=_summary_markdown(config, summary, tracker),
                             description=f"gymflow run {run_id}")
    return summary


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
