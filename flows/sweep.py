"""A sweep as a Prefect flow: configurations asked of an Optuna study that outlives the flow,
each run as ordinary improve runs (one a seed) on one shared Dask cluster, then ranked by the
interquartile mean of their seeds.

Killed at any point and started again with the same sweep id, it redoes nothing: finished runs
are read from the study, interrupted runs resume from their last checkpoint, and runs not
started yet start. The table it ends with is the one an uninterrupted sweep ends with.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from mlflow import MlflowClient
from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture, as_completed
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from gymflow.flows.improve import improve
from gymflow.presets.load import flatten
from gymflow.presets.sweep import Sweep, SweepSpec, check_sweep, sweep_spec
from gymflow.tasks.cluster.client import shared_local_cluster
from gymflow.tasks.storage.layout import sweep_best_preset
from gymflow.tasks.storage.objects import StorageLocation, check_storage, open_storage, storage_location
from gymflow.tasks.storage.records import has_run_record
from gymflow.tasks.sweep.aggregate import area_under_curve
from gymflow.tasks.sweep.report import RankedConfiguration, best_preset_yaml, plot_sweep_curves, rank, ranking_markdown
from gymflow.tasks.sweep.study import (
    Configuration,
    SeedResult,
    configurations,
    finish_configuration,
    new_sweep_id,
    next_wave,
    open_study,
    record_result,
    refreshed,
)
from gymflow.tasks.sweep.trial import SweepTrial
from gymflow.tasks.tracking.tracker import Tracker

MAX_CONCURRENCY = 64
PARENT_RUN_ATTR = "mlflow_parent_run_id"


@dataclass(frozen=True)
class SweepResult:
    sweep_id: str
    ranking: list[dict[str, Any]]  # the table, best first
    best_preset_url: str | None  # the best configuration as a preset YAML (`gymflow run` takes it)
    mlflow_parent_run_id: str
    runs_trained: int  # runs this start trained to their end (a restart counts only its own)
    wall_seconds: float = 0.0


@dataclass(frozen=True)
class SeedRun:
    """One improve run of a sweep: a configuration's seed."""

    sweep: Sweep
    sweep_id: str
    configuration: Configuration
    seed: int
    mlflow_parent_run_id: str

    @property
    def run_id(self) -> str:
        return self.configuration.run_id(self.sweep_id, self.seed)

    @property
    def reports(self) -> bool:
        """The configuration's first seed reports its evaluations to the pruner."""
        return self.seed == self.sweep.seeds()[0]


@dataclass
class Progress:
    total: int
    done: int = 0
    artifact_id: Any = field(default=None)


@flow(name="sweep", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=MAX_CONCURRENCY))
def sweep(spec: SweepSpec, sweep_id: str | None = None) -> SweepResult:
    """Search preset fields over configurations x seeds, each an improve run, and rank them.

    Args:
        spec: The preset, the fields to search, the sampler, seeds per configuration, the budget,
            the concurrency and the pruner (docs/usage.md, "Sweeps").
        sweep_id: Start a new sweep with this id, or continue the sweep of this id where it
            stopped (a crash, a kill): finished runs are kept, interrupted ones resume.
    """
    checked = check_sweep(sweep_spec(spec))  # bad input stops here; nothing written
    location = storage_location(checked.base.storage)
    check_storage(location)
    sweep_id = sweep_id or new_sweep_id(checked.base.name)
    study = open_study(checked, sweep_id)
    logger = get_run_logger()
    started = time.perf_counter()
    trained = 0
    with (
        shared_local_cluster(checked.base.distribution, checked.spec.concurrency * _workers(checked)),
        _parent_run(checked, sweep_id, study) as parent,
    ):
        progress = Progress(checked.configurations * checked.spec.seeds)
        progress.done = sum(len(c.results) for c in configurations(study))
        progress.artifact_id = create_progress_artifact(_percent(progress), key="sweep-progress",
                                                        description=f"runs of sweep {sweep_id}")
        logger.info("sweep %s: %d configurations x %d seeds; Optuna study in %s; MLflow parent run %s",
                    sweep_id, checked.configurations, checked.spec.seeds, checked.spec.study_storage, parent.run_id)
        while wave := next_wave(study, checked):
            runs = [SeedRun(checked, sweep_id, configuration, seed, parent.run_id)
                    for configuration in wave for seed in checked.seeds()]
            for seed_run, result in _run_wave(study, runs, checked.spec.concurrency):
                record_result(study, seed_run.configuration, result)
                trained += 1
                progress.done += 1
                update_progress_artifact(progress.artifact_id, _percent(progress))
                logger.info("configuration %d seed %d: final return %.2f%s (%d of %d runs)",
                            seed_run.configuration.number, seed_run.seed, result.final_return,
                            " (pruned)" if result.pruned else "", progress.done, progress.total)
            for configuration in wave:
                _finish(study, refreshed(study, configuration), checked)
        ranking = rank(configurations(study), checked.spec.seeds)
        best_url = _report(checked, sweep_id, ranking, parent, location)
    rows = [ranked.row() for ranked in ranking]
    logger.info("sweep %s done: best %s", sweep_id, rows[0] if rows else "none")
    return SweepResult(sweep_id, rows, best_url, parent.run_id, trained, time.perf_counter() - started)


def _workers(sweep: Sweep) -> int:
    return sweep.base.distribution.rollout_workers


def _percent(progress: Progress) -> float:
    return 100.0 * progress.done / max(progress.total, 1)


def _run_wave(study: optuna.Study, runs: list[SeedRun], concurrency: int) -> Iterator[tuple[SeedRun, SeedResult]]:
    """The wave's runs not finished yet, at most `concurrency` at once, in order; a run whose
    configuration was pruned meanwhile is not started. Yields each finished run's result."""
    pending = [run for run in runs if run.seed not in run.configuration.results]
    running: dict[PrefectFuture, SeedRun] = {}
    while pending or running:
        while pending and len(running) < concurrency:
            run = pending.pop(0)
            if refreshed(study, run.configuration).pruned:
                continue
            running[train_seed.submit(run)] = run
        if not running:
            break
        future = next(as_completed(list(running)))
        run = running.pop(future)
        try:
            yield run, future.result()
        except Exception as error:  # noqa: BLE001 (a failed run fails its configuration, not the sweep)
            get_run_logger().warning("configuration %d seed %d failed: %s", run.configuration.number,
                                     run.seed, str(error).splitlines()[0] if str(error) else repr(error))


@task(name="train-seed", task_run_name="train-c{seed_run.configuration.number}-seed{seed_run.seed}",
      cache_policy=NO_CACHE)
def train_seed(seed_run: SeedRun) -> SeedResult:
    """One improve run of the configuration: resumed where a killed sweep left it, else new."""
    sweep, configuration = seed_run.sweep, seed_run.configuration
    overrides = sweep.trial_overrides(configuration.params, seed_run.seed)
    storage = open_storage(storage_location(sweep.base.storage))
    trial = SweepTrial(sweep_id=seed_run.sweep_id, study_storage=sweep.spec.study_storage,
                       trial_id=configuration.trial_id, configuration=configuration.number, seed=seed_run.seed,
                       reports=seed_run.reports, pruner=sweep.spec.pruner,
                       mlflow_parent_run_id=seed_run.mlflow_parent_run_id)
    resuming = has_run_record(storage, seed_run.run_id)
    named = improve.with_options(flow_run_name=f"{seed_run.run_id}{' (resumed)' if resuming else ''}")
    summary = named(sweep.spec.preset, overrides, resume=seed_run.run_id if resuming else None,
                    run_id=None if resuming else seed_run.run_id, sweep_trial=trial)
    curve = tuple((row.env_steps, row.mean) for row in summary.evaluations)
    total = sweep.trial_preset(configuration.params).schedule.total_env_steps
    if summary.stopped_early:
        MlflowClient(sweep.base.tracking.tracking_uri).set_tag(summary.mlflow_run_id, "gymflow.sweep.pruned", "true")
    return SeedResult(seed_run.seed, summary.run_id, summary.mlflow_run_id, float(summary.final_return),
                      area_under_curve([s for s, _ in curve], [v for _, v in curve], total), curve,
                      summary.stopped_early)


def _finish(study: optuna.Study, configuration: Configuration, sweep: Sweep) -> None:
    ranked = rank([configuration], sweep.spec.seeds)[0]
    objective = ranked.final_return.value if ranked.outcome == "complete" else None
    finish_configuration(study, configuration, objective)


@contextmanager
def _parent_run(sweep: Sweep, sweep_id: str, study: optuna.Study) -> Iterator[Tracker]:
    """The sweep's MLflow run, the parent of its runs; a restarted sweep reopens its own."""
    tracking = sweep.base.tracking
    existing = study.user_attrs.get(PARENT_RUN_ATTR)
    tracker = Tracker(tracking.tracking_uri, tracking.experiment, run_name=f"sweep {sweep_id}",
                      tags={"gymflow.sweep_id": sweep_id, "gymflow.sweep.role": "parent",
                            "prefect.flow_run_id": str(flow_run.id), "gymflow.preset": sweep.base.name},
                      artifact_location=tracking.artifact_location, existing_run_id=existing)
    if existing is None:
        spec = sweep.spec.model_dump(mode="json")
        tracker.log_params(flatten({key: value for key, value in spec.items() if key != "space"}))
        tracker.log_params({f"space.{key}": value for key, value in spec["space"].items()})
        study.set_user_attr(PARENT_RUN_ATTR, tracker.run_id)
    status = "FINISHED"
    try:
        yield tracker
    except BaseException as ended:  # a stop from outside is KILLED, an error FAILED
        status = "FAILED" if isinstance(ended, Exception) else "KILLED"
        raise
    finally:
        tracker.finish(status)


def _report(sweep: Sweep, sweep_id: str, ranking: list[RankedConfiguration], parent: Tracker,
            location: StorageLocation) -> str | None:
    """The ranking (Prefect table artifact; MLflow table, markdown and plot on the parent run),
    and the best configuration as a preset YAML in storage and on the parent run."""
    rows = [ranked.row() for ranked in ranking]
    client = MlflowClient(sweep.base.tracking.tracking_uri)
    client.log_dict(parent.run_id, {"ranking": rows}, "ranking.json")
    client.log_text(parent.run_id, ranking_markdown(sweep_id, ranking), "ranking.md")
    with tempfile.TemporaryDirectory() as folder:
        plot = plot_sweep_curves(ranking, str(Path(folder, "sweep_curves.png")),
                                 title=f"sweep {sweep_id}: {sweep.spec.preset}")
        parent.log_artifact(plot)
    create_table_artifact(key="sweep-ranking", table=rows,
                          description=f"sweep {sweep_id}: configurations by the IQM of their seeds' final returns")
    best = ranking[0] if ranking and ranking[0].outcome == "complete" else None
    if best is None:
        return None
    parent.log_metrics({"sweep/best_final_return_iqm": best.final_return.value,
                                "sweep/best_configuration": float(best.configuration.number)}, step=0)
    client.set_tag(parent.run_id, "gymflow.sweep.best_run_ids",
                   ",".join(result.run_id for result in best.configuration.results.values()))
    preset_yaml = best_preset_yaml(sweep, best)
    client.log_text(parent.run_id, preset_yaml.decode(), "best-preset.yaml")
    storage = open_storage(location)
    key = sweep_best_preset(sweep_id)
    storage.write(key, preset_yaml)
    create_markdown_artifact(key="sweep-best-preset", markdown=f"```yaml\n{preset_yaml.decode()}```",
                             description=f"sweep {sweep_id}: the best configuration, for `gymflow run`")
    return storage.url(key)
