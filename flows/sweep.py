"""A sweep as a Prefect flow: configurations asked of an Optuna study that outlives the flow,
each run as ordinary improve runs (one a seed) on one shared Dask cluster, then ranked by the
interquartile mean of their seeds.

Killed at any point and started again with the same sweep id, it redoes nothing: finished runs
are read from the study, interrupted runs resume from their last checkpoint, and runs not
started yet start. The table it ends with is the one an uninterrupted sweep ends with.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import optuna
from prefect import get_run_logger, task
from prefect.artifacts import (
    create_progress_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from gymflow.flows.improve import improve
from gymflow.flows.parameters import checked_flow, overrides_checked, refusal_said
from gymflow.flows.population import train_population
from gymflow.flows.stopping import STOP_GRACE_S, cancellable, deployment_of_this_run
from gymflow.flows.waiting import first_finished
from gymflow.presets.sweep import Sweep, SweepSpec, check_sweep, sweep_spec
from gymflow.stops import a_run, runs_ended_first
from gymflow.tasks.cluster.client import shared_local_cluster
from gymflow.tasks.storage.layout import new_sweep_id
from gymflow.tasks.storage.objects import check_storage, open_storage, storage_location
from gymflow.tasks.storage.records import has_run_record
from gymflow.tasks.sweep.lineage import report_population
from gymflow.tasks.sweep.pbt import MemberResult, check_perturbable, pause_points, recorded_results
from gymflow.tasks.sweep.report import mark_pruned, rank, report_sweep, sweep_parent_run
from gymflow.tasks.sweep.study import (
    Configuration,
    SeedResult,
    configurations,
    finish_configuration,
    next_wave,
    open_study,
    record_result,
    refreshed,
)
from gymflow.tasks.sweep.trial import SweepTrial
from gymflow.tasks.tracking.blocks import preset_with_block_options
from gymflow.tasks.tracking.events import sweep_finished
from gymflow.tasks.tracking.servers import check_tracking_server
from gymflow.tasks.tracking.tracker import Tracker
from gymflow.work import began

MAX_CONCURRENCY = 64


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


@checked_flow(name="sweep", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=MAX_CONCURRENCY))
def sweep(spec: SweepSpec, sweep_id: str | None = None) -> SweepResult:
    """Search preset fields over configurations x seeds, each an improve run, and rank them.

    Args:
        spec: The preset, the fields to search, the sampler, seeds per configuration, the budget,
            the concurrency and the pruner (docs/sweeps.md, "Sweeps").
        sweep_id: Start a new sweep with this id, or continue the sweep of this id where it
            stopped (a crash, a kill): finished runs are kept, interrupted ones resume.
    """
    with refusal_said():
        checked = check_sweep(sweep_spec(spec))  # bad input stops here; nothing written
        overrides_checked(checked.spec.overrides)  # a credential in a deployment run's parameters stops here
        if checked.spec.pbt is not None:
            check_perturbable(checked)
        checked = replace(checked, base=preset_with_block_options(checked.base))  # storage credentials in a block
        location = storage_location(checked.base.storage)
        check_storage(location)
        check_tracking_server(checked.base.tracking.tracking_uri, checked.base.tracking.experiment)
    sweep_id = sweep_id or new_sweep_id(checked.base.name)
    study = open_study(checked, sweep_id)
    began(sweep_id)  # from here on the sweep has a study: its log stays whatever ends it
    logger = get_run_logger()
    started = time.perf_counter()
    trained = 0
    with (
        cancellable(flow_run.id, deployment_of_this_run()),  # a Prefect cancellation ends it within seconds
        shared_local_cluster(checked.base.distribution, checked.spec.concurrency * _workers(checked)),
        sweep_parent_run(checked, sweep_id, study, str(flow_run.id)) as parent,
        runs_ended_first(STOP_GRACE_S / 2),  # a stopped sweep's runs end (each at its next step) before the cluster
    ):
        if checked.spec.pbt is not None:
            return _population(checked, sweep_id, study, parent, started)
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
        best_url = report_sweep(checked, sweep_id, ranking, parent, location)
    rows = [ranked.row() for ranked in ranking]
    logger.info("sweep %s done: best %s", sweep_id, _in_words(rows[0]) if rows else "none")
    sweep_finished(sweep_id, rows[0] if rows else None, best_url)
    return SweepResult(sweep_id, rows, best_url, parent.run_id, trained, time.perf_counter() - started)


def _population(sweep: Sweep, sweep_id: str, study: optuna.Study, parent: Tracker, started: float) -> SweepResult:
    """`sampler: pbt`: the members trained interval by interval (flows/population.py), then
    ranked, with their lineage."""
    logger = get_run_logger()
    intervals = len(pause_points(sweep))
    progress = Progress(sweep.configurations * intervals)
    progress.done = sum(len(recorded_results(study, interval)) for interval in range(intervals))
    progress.artifact_id = create_progress_artifact(_percent(progress), key="sweep-progress",
                                                    description=f"member intervals of sweep {sweep_id}")
    logger.info("sweep %s: a population of %d members, %d intervals of %s steps; Optuna storage %s; MLflow parent "
                "run %s", sweep_id, sweep.configurations, intervals, f"{sweep.spec.pbt.interval:,}",
                sweep.spec.study_storage, parent.run_id)

    def reached(result: MemberResult) -> None:
        progress.done += 1
        update_progress_artifact(progress.artifact_id, _percent(progress))
        logger.info("member %d interval %d: %s at %s steps, score %.2f (%d of %d)", result.member, result.interval,
                    "finished" if result.finished else "paused", f"{result.clock:,}", result.score, progress.done,
                    progress.total)

    population = train_population(sweep, sweep_id, study, parent.run_id, reached)
    update_progress_artifact(progress.artifact_id, 100.0)  # members that reached their target ended early
    rows, best_url = report_population(sweep, sweep_id, population, parent, storage_location(sweep.base.storage))
    logger.info("sweep %s done: best %s", sweep_id, _in_words(rows[0]) if rows else "none")
    sweep_finished(sweep_id, rows[0] if rows else None, best_url)
    return SweepResult(sweep_id, rows, best_url, parent.run_id, population.trained, time.perf_counter() - started)


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
        future = first_finished(list(running))
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
    with a_run():  # counted before its flow run is made (seconds on a busy SQLite): a stop meanwhile ends it
        summary = named(sweep.spec.preset, overrides, resume=seed_run.run_id if resuming else None,
                        run_id=None if resuming else seed_run.run_id, sweep_trial=trial)
    if summary.stopped_early:
        mark_pruned(sweep.base.tracking.tracking_uri, summary.mlflow_run_id)
    return SeedResult.of(seed_run.seed, summary, sweep.trial_preset(configuration.params).schedule.total_env_steps)


def _finish(study: optuna.Study, configuration: Configuration, sweep: Sweep) -> None:
    ranked = rank([configuration], sweep.spec.seeds)[0]
    objective = ranked.final_return.value if ranked.outcome == "complete" else None
    finish_configuration(study, configuration, objective)


def _in_words(row: dict) -> str:
    """A ranking row as a log line: `configuration 0 (agent.lr=0.01): final return IQM 0.953 ...`
    (a population's: `member 2 (...): ...`)."""
    named = "configuration" if "configuration" in row else "member"
    searched = ", ".join(f"{key}={value}" for key, value in row.items() if "." in key and " " not in key)
    figures = ", ".join(f"{key} {value}" for key, value in row.items()
                        if key not in ("rank", named, "run") and not ("." in key and " " not in key))
    return f"{named} {row[named]} ({searched}): {figures}"
