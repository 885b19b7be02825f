"""Delivering a finished run: the policy the deciding evaluation scored (as an MLflow model, and
its checkpoint where the cadence wrote one), the preset, the learning curve, and a summary for
the Prefect UI."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

from gymflow.tasks.storage.checkpoints import POLICY_BLOB, committed_versions, read_policy
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.tracking.models import log_policy_model
from gymflow.tasks.tracking.plots import plot_learning_curve
from gymflow.tasks.tracking.tracker import Tracker
from gymflow.tasks.training.run import PreparedRun
from gymflow.tasks.training.summary import RunSummary


def deliver(run: PreparedRun, tracker: Tracker, summary: RunSummary, history: list[dict[str, float]]) -> RunSummary:
    """Log the run's artifacts, model and summary figures to MLflow; returns the summary with the
    model's URI."""
    config = run.preset
    with tempfile.TemporaryDirectory() as folder:
        preset_file = Path(folder, "preset.yaml")
        preset_file.write_bytes(run.preset_yaml())
        tracker.log_artifact(str(preset_file))
        layout, delivered = RunLayout(run.run_id), summary.delivered_version
        if delivered in committed_versions(run.storage, layout):  # kept beside the newest checkpoints
            checkpoint_dir = Path(folder, "checkpoint")
            run.storage.download(layout.checkpoint(delivered), str(checkpoint_dir))
            tracker.log_artifact(str(checkpoint_dir), "checkpoint")
        policy = read_policy(run.storage, layout, delivered, [POLICY_BLOB])[POLICY_BLOB]
        model_uri = log_policy_model(tracker, policy, run.preset_yaml())
        title = f"{config.name}: {config.agent.algo.upper()} on {config.env.id}"
        curve = plot_learning_curve(history, summary.evaluations, str(Path(folder, "learning_curve.png")), title=title,
                                    target_return=config.schedule.target_return)
        tracker.log_artifact(curve)
    tracker.set_tags({"gymflow.delivered_version": str(summary.delivered_version),
                      "gymflow.solved": str(summary.solved)})
    tracker.log_metrics({
        "summary/wall_seconds": summary.wall_seconds,
        "summary/orchestration_share": summary.orchestration_share,
        "summary/final_return": summary.final_return or 0.0,
        "summary/best_return": summary.best_return or 0.0,
    }, step=summary.env_steps)
    return replace(summary, model_uri=model_uri)


def summary_markdown(run: PreparedRun, summary: RunSummary, tracker: Tracker) -> str:
    """The run's summary as a Markdown table, for the Prefect UI."""
    config, uri = run.preset, run.preset.tracking.tracking_uri
    # MLflow 3.17's UI shows every experiment in its GenAI view unless the link asks for model training
    page = f"#/experiments/{tracker.experiment_id}/runs/{summary.mlflow_run_id}?workflowType=machine_learning"
    if uri.startswith(("http://", "https://")):
        mlflow_link = f"[{summary.mlflow_run_id}]({uri.rstrip('/')}/{page})"
    else:
        mlflow_link = f"`{summary.mlflow_run_id}` (`mlflow ui --backend-store-uri {uri}`, then `{page}`)"
    rows = [
        ("preset", f"`{config.name}`: {config.agent.algo.upper()} on `{config.env.id}`"),
        ("final evaluation return", f"{summary.final_return:.2f}"),
        ("best evaluation return", f"{summary.best_return:.2f}"),
        ("target reached", "yes" if summary.solved else "no"),
        ("environment steps", f"{summary.env_steps:,}"),
        ("training wall-clock",
         f"{summary.wall_seconds:.1f} s ({100 * summary.orchestration_share:.0f}% orchestration)"),
        ("versions committed", f"{summary.versions_committed} (delivered v{summary.delivered_version})"),
        ("MLflow run", mlflow_link),
        ("MLflow model", f"`{summary.model_uri}`"),
        ("checkpoints and shards", f"`{summary.storage_url}`"),
    ]
    return "| | |\n|---|---|\n" + "\n".join(f"| {name} | {value} |" for name, value in rows)


def describe(summary: RunSummary) -> str:
    """One log line with the summary's figures (evaluations left out)."""
    fields = {name: getattr(summary, name) for name in summary.__dataclass_fields__ if name != "evaluations"}
    fields["orchestration_share"] = round(summary.orchestration_share, 3)
    return ", ".join(f"{key}={value}" for key, value in fields.items())
