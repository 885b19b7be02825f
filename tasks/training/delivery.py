"""Delivering a finished run: the policy the deciding evaluation scored (as an MLflow logged
model, and its checkpoint where the cadence wrote one), the preset, the learning curve, and a
summary: the MLflow run's description, and a report for the Prefect UI."""

from __future__ import annotations

import base64
import logging
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from gymflow.errors import GymflowError
from gymflow.last_steps import held
from gymflow.presets.redaction import without_password
from gymflow.presets.validate import rank_devices
from gymflow.tasks.storage.checkpoints import POLICY_BLOB, committed_versions, read_policy
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.tracking.pages import RETURN_TAG, return_words, run_page, runs_page, served_by, ui_url, where_to_see
from gymflow.tasks.tracking.plots import plot_learning_curve
from gymflow.tasks.tracking.servers import is_tracking_server
from gymflow.tasks.tracking.tracker import Tracker
from gymflow.tasks.training.run import PreparedRun
from gymflow.tasks.training.summary import RunRecorder, RunSummary

LEARNING_CURVE = "learning_curve.png"


class Delivered(NamedTuple):
    summary: RunSummary  # with the logged model's URI
    learning_curve: bytes  # the PNG


@held("the run's delivery")  # a lost Prefect API's deadline waits for it: the model reaches MLflow
def deliver(run: PreparedRun, tracker: Tracker, summary: RunSummary, recorder: RunRecorder) -> Delivered:
    """Log the run's artifacts, summary figures and model to MLflow. The model is logged last, at
    the run's final env step, so the summary figures and the final evaluation's metrics are
    linked to it."""
    from gymflow.tasks.tracking.models import PolicyModel, log_policy_model  # MLflow's model code, here only

    config, started = run.preset, time.perf_counter()
    where = without_password(config.tracking.tracking_uri)
    _say(recorder, summary, f"done: v{summary.delivered_version} delivered, evaluation {summary.final_return:.1f}")
    _say(recorder, summary, f"delivering v{summary.delivered_version} to MLflow ({where}): preset, checkpoint, curve")
    with tempfile.TemporaryDirectory() as folder:
        preset_file = Path(folder, "preset.yaml")
        preset_file.write_bytes(run.preset_yaml())
        tracker.log_artifact(str(preset_file))
        layout, delivered = RunLayout(run.run_id), summary.delivered_version
        if delivered in committed_versions(run.storage, layout):  # kept beside the newest checkpoints
            checkpoint_dir = Path(folder, "checkpoint")
            run.storage.download(layout.checkpoint(delivered), str(checkpoint_dir))
            tracker.log_artifact(str(checkpoint_dir), "checkpoint")
        title = f"{config.name}: {config.agent.algo.upper()} on {config.env.id}"
        curve = plot_learning_curve(recorder.history, summary.evaluations, str(Path(folder, LEARNING_CURVE)),
                                    title=title, target_return=config.schedule.target_return)
        tracker.log_artifact(curve)
        curve_png = Path(curve).read_bytes()
    tracker.set_tags(_outcome_tags(summary))
    tracker.log_metrics({
        "summary/wall_seconds": summary.wall_seconds,
        "summary/orchestration_share": summary.orchestration_share,
        "summary/final_return": round(summary.final_return or 0.0, 2),  # as read: MLflow shows every digit
        "summary/best_return": round(summary.best_return or 0.0, 2),
    }, step=summary.clock)
    tracker.flush()  # the metrics are linked to the model as it is logged
    _say(recorder, summary, f"delivering v{summary.delivered_version} to MLflow ({where}): the policy model")
    policy = read_policy(run.storage, layout, delivered, [POLICY_BLOB])[POLICY_BLOB]
    model = PolicyModel(policy, run.preset_yaml(), run.experiment.observation_space, run.experiment.action_space,
                        run.params(), memory_size=getattr(run.preset.agent, "recurrent", None),
                        label=f"{config.name}-v{delivered}",
                        # the final step's evaluation is the delivered version's only where it is the last
                        linked=("summary/", "eval/") if summary.last is None else ("summary/",))
    model_uri = log_policy_model(tracker, model, step=summary.clock)
    _log_each_policy(run, tracker, model, summary.clock)
    _say(recorder, summary, f"delivering v{summary.delivered_version} to MLflow ({where}): its ONNX graph")
    _log_onnx_policy(run, tracker, model, summary, recorder)
    if recorder.events is not None:
        recorder.events.finished({"final_return": summary.final_return, "solved": summary.solved,
                                  "target_return": summary.target_return, "env_steps": summary.env_steps,
                                  "delivered_version": summary.delivered_version, "model_uri": model_uri},
                                 summary.solved)
    recorder.progress.logger.info("v%d delivered to MLflow (%s) in %.1f s: %s", summary.delivered_version, where,
                                  time.perf_counter() - started, model_uri)
    recorder.progress.finish(summary.clock, delivered_words(summary) + _against_target(summary))
    page = where_to_see(where, run_page(tracker.experiment_id, summary.mlflow_run_id))
    return Delivered(replace(summary, model_uri=model_uri, mlflow_page=page), curve_png)


def _outcome_tags(summary: RunSummary) -> dict[str, str]:
    said = return_words(summary.final_return or 0.0, summary.delivered_version, summary.best_return or 0.0,
                        delivered=True)
    return ({"gymflow.delivered_version": str(summary.delivered_version), RETURN_TAG: said}
            | ({} if summary.target_return is None else {"gymflow.solved": str(summary.solved)}))


def _say(recorder: RunRecorder, summary: RunSummary, status: str) -> None:
    """What delivery is doing, on the progress bar and in the run's log (through a tracking
    server it takes seconds: docs/benchmarks.md, "Delivery through a team's servers")."""
    recorder.progress.update(summary.clock, status, force=True)


def _log_onnx_policy(run: PreparedRun, tracker: Tracker, model: Any, summary: RunSummary,
                     recorder: RunRecorder) -> None:
    """The delivered policy as an ONNX graph too (agents/export.py), checked against the policy by ONNX
    Runtime and logged beside the pyfunc model (`policy-onnx`, the run's tag `gymflow.onnx_model`);
    where it cannot be one, a line says why and the run goes on."""
    from gymflow.agents.export import CannotExport, OnnxNotInstalled, onnx_policy
    from gymflow.tasks.tracking.models import log_onnx_policy

    experiment, names = run.experiment, _separate_policies(run)
    try:  # every group's graph before any is logged: a run's graphs are all logged or none
        graphs = {name: onnx_policy(experiment.algorithm, run.preset.agent, experiment.observation_space,
                                    experiment.action_space, model.policy, name) for name in names or [None]}
        uris = {name: log_onnx_policy(tracker, replace(model, policy_name=name), graph, summary.clock)
                for name, graph in graphs.items()}
    except GymflowError:  # a server lost meanwhile: the run's own end, not the graph's
        raise
    except Exception as why:  # noqa: BLE001 - any failure of the export (its own refusal, the exporter's, ONNX
        # Runtime's check, the graph's logging) leaves the run delivered by its pyfunc model, as the docs say
        said = str(why) if isinstance(why, CannotExport) else \
            f"the export failed ({type(why).__name__}: {' '.join(str(why).split())[:200]})"
        level = logging.INFO if isinstance(why, OnnxNotInstalled) else logging.WARNING  # an install's choice
        recorder.progress.logger.log(level, "v%d is not exported to ONNX: %s; its pyfunc model serves it",
                                     summary.delivered_version, said)
        return
    if names:  # agent groups' separate policies: a graph each, as each has a pyfunc model of its own
        tracker.set_tags({"gymflow.onnx_models": ", ".join(f"{name}={uri}" for name, uri in uris.items())})
    else:
        tracker.set_tags({"gymflow.onnx_model": uris[None]})


def _log_each_policy(run: PreparedRun, tracker: Tracker, model: Any, step: int) -> None:
    """Where agent groups act with separate policies (agent.policies), each is also a logged model
    of its own (`policy-<name>`), named in the run's tag `gymflow.policy_models`."""
    from gymflow.tasks.tracking.models import log_policy_model

    if names := _separate_policies(run):
        uris = {name: log_policy_model(tracker, replace(model, policy_name=name), step) for name in names}
        tracker.set_tags({"gymflow.policy_models": ", ".join(f"{name}={uri}" for name, uri in uris.items())})


def _separate_policies(run: PreparedRun) -> list[str]:
    """The names of the policies agent groups act with where they are several (agent.policies); else []."""
    if not getattr(run.preset.agent, "policies", None):
        return []
    names = list(dict.fromkeys(run.preset.agent.policy_of_each(run.experiment.observation_space.groups)))
    return names if len(names) > 1 else []


def report_run(run: PreparedRun, tracker: Tracker, delivered: Delivered, recorder: RunRecorder) -> str:
    """Describe the run in MLflow (the summary table, its films named); returns the Markdown for
    the Prefect UI: the table and the learning curve."""
    table = summary_table(run, delivered.summary, tracker, recorder.films)
    tracker.describe(table)
    curve_image = f"![learning curve](data:image/png;base64,{base64.b64encode(delivered.learning_curve).decode()})"
    return f"{table}\n\n{curve_image}\n"


def summary_table(run: PreparedRun, summary: RunSummary, tracker: Tracker, films: list[str]) -> str:
    """The run's summary as a Markdown table, with links into the MLflow UI where it is served."""
    config, uri = run.preset, without_password(run.preset.tracking.tracking_uri)  # the table is a Prefect artifact
    served = is_tracking_server(uri)
    run_url, runs_url = (ui_url(uri, page) for page in (run_page(tracker.experiment_id, summary.mlflow_run_id),
                                                        runs_page(tracker.experiment_id)))
    mlflow_link = f"[{summary.mlflow_run_id}]({run_url}){served_by(uri)}"
    if films and served:
        film = f"[{films[-1]}]({uri.rstrip('/')}/get-artifact?path={films[-1]}&run_uuid={summary.mlflow_run_id})"
    else:
        film = f"`{films[-1]}` in the MLflow run's artifacts" if films else "none (see tracking.video)"
    rows = [
        ("preset", f"`{config.name}`: {config.agent.algo.upper()} on `{config.env.id}`"),
        ("final evaluation return", f"{summary.final_return:.2f}"),
        ("best evaluation return", f"{summary.best_return:.2f}"),
        ("target reached", "yes" if summary.solved else "no"),
        ("environment steps", f"{summary.env_steps:,}") if summary.gradient_steps is None
        else ("gradient steps (offline)", f"{summary.gradient_steps:,} on `{config.dataset.name}`"),
        ("training wall-clock",
         f"{summary.wall_seconds:.1f} s ({100 * summary.orchestration_share:.0f}% orchestration)"),
        ("versions committed", f"{summary.versions_committed} (delivered v{summary.delivered_version})"),
        ("learner", _learner_words(rank_devices(config, run.experiment.observation_space))),
        ("MLflow run", mlflow_link),
        ("the experiment's runs by return", f"[{config.tracking.experiment}]({runs_url})"),
        ("MLflow model", f"`{summary.model_uri}`"),
        ("video of the final policy", film),
        ("checkpoints and shards", f"`{summary.storage_url}`"),
    ]
    return "| | |\n|---|---|\n" + "\n".join(f"| {name} | {value} |" for name, value in rows)


def _learner_words(devices: list[str]) -> str:
    """Where the learner learnt: its device, or each rank's (distribution.learners)."""
    return f"on {devices[0]}" if len(devices) == 1 else f"{len(devices)} ranks, on {', '.join(devices)}"


def describe(summary: RunSummary) -> str:
    """The run's outcome on one line, for a person (the summary's figures; evaluations left out)."""
    clock = f"{summary.gradient_steps:,} gradient steps" if summary.gradient_steps is not None \
        else f"{summary.env_steps:,} env steps"
    parts = [f"{clock} in {summary.wall_seconds:.1f} s ({100 * summary.orchestration_share:.0f}% orchestration)"]
    if summary.final_return is not None:
        parts.append(delivered_words(summary) + _against_target(summary))
    if summary.stopped_early:
        parts.append("pruned by the sweep")
    if summary.shards_inserted or summary.shards_dropped or summary.shards_unused:
        parts.append(f"{summary.shards_inserted:,} chunks learned from, {summary.shards_dropped:,} dropped past the "
                     f"lag bound, {summary.shards_unused:,} after the stop (lag {summary.policy_lag_mean:.2f} on "
                     f"average, {summary.policy_lag_max} at most)")
    parts += [f"model {summary.model_uri}" if summary.model_uri else "no model logged",
              f"MLflow run {summary.mlflow_run_id}", f"stored at {summary.storage_url}"]
    return "; ".join(parts)


def delivered_words(summary: RunSummary) -> str:
    """Which version is delivered and how it scored; the last version's score where it is another."""
    said = f"v{summary.delivered_version} delivered: evaluation return {summary.final_return:.1f}"
    if summary.last is None:
        best = summary.best_return
        if best is None:
            return said
        return said + (" (the best)" if best == summary.final_return else f", best {best:.1f}")
    return f"{said} (the best; the last version, v{summary.last.version}, scored {summary.last.mean_return:.1f})"


def _against_target(summary: RunSummary) -> str:
    if summary.target_return is None:
        return ""
    return f", target {summary.target_return:g} {'reached' if summary.solved else 'not reached'}"
