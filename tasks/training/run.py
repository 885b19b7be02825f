"""Setting a run up for the improve flow: its identity, its learner (fresh, warm-started or
restored), its MLflow run, and the parts of its loop; and its first state (heatup and version 0)."""

from __future__ import annotations

import json
from collections.abc import Container, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import yaml

from gymflow.agents.core import Learner, ReplayLearner
from gymflow.commands import gymflow_command
from gymflow.errors import InvalidPreset, ServerLost
from gymflow.last_steps import before_exit_now, end_within, held
from gymflow.logs import AnyLogger
from gymflow.outage import Outage
from gymflow.presets.load import flatten
from gymflow.presets.model import DatasetConfig, Preset
from gymflow.presets.redaction import MASK, is_secret, redacted, redacted_uri
from gymflow.presets.validate import (
    Experiment,
    inference_beside_learner,
    learner_device,
    rank_devices,
    rollout_backend,
)
from gymflow.tasks.cluster.hosts import Hosts
from gymflow.tasks.cluster.inference import InferenceServer, InferenceUnavailable
from gymflow.tasks.cluster.messages import InferenceAddress
from gymflow.tasks.cluster.rounds import RoundPlan
from gymflow.tasks.lake.source import ExperienceDataset, open_dataset
from gymflow.tasks.storage.checkpoints import committed_versions
from gymflow.tasks.storage.layout import RunLayout, new_run_id
from gymflow.tasks.storage.objects import STORE_FIELD, Storage, ready_storage, storage_location
from gymflow.tasks.storage.records import (
    RunRecord,
    has_run_record,
    read_run_record,
    read_stored_preset,
    write_run_record,
    write_stored_preset,
)
from gymflow.tasks.sweep.trial import PbtCopy, PbtMember, log_member_interval
from gymflow.tasks.tracking.artifacts import ProgressArtifact
from gymflow.tasks.tracking.blocks import with_block_options
from gymflow.tasks.tracking.events import RunEvents
from gymflow.tasks.tracking.pages import NOT_EVALUATED, RETURN_TAG
from gymflow.tasks.tracking.prefect_watch import prefect_watched
from gymflow.tasks.tracking.progress import ProgressLog
from gymflow.tasks.tracking.servers import check_tracking_server, refusal_of
from gymflow.tasks.tracking.system_metrics import SystemMetrics
from gymflow.tasks.tracking.tracker import Tracker, TrackerOptions, s3_artifact_environment, source_tags
from gymflow.tasks.training.batch_stream import BatchStream
from gymflow.tasks.training.collection import Collection, OfflineSteps, SyncRounds
from gymflow.tasks.training.commits import Commits
from gymflow.tasks.training.evaluation import EvaluationSchedule, Standing
from gymflow.tasks.training.gpu_slot import gpu_slots
from gymflow.tasks.training.learner_ranks import LearnerRanks
from gymflow.tasks.training.learning import create_learner
from gymflow.tasks.training.loop import EarlyStop, ImproveLoop, Observer, StopRule, heatup, read_dataset
from gymflow.tasks.training.resume import (
    LEARNER_WARM_START,
    Restored,
    copy_replay_memory,
    learner_source,
    restore,
    stored_experiment,
    warm_start_learner,
)
from gymflow.tasks.training.state import Budget, LoopState, planned_total
from gymflow.tasks.training.stream import AsyncStream, Batches, Ratio
from gymflow.tasks.training.summary import EvaluationRow, RunRecorder
from gymflow.work import began

FINAL_REPORT_GRACE_S = 15.0  # a run that stopped for a lost server: its final report to Prefect at most this


@dataclass(frozen=True)
class PreparedRun:
    """A run about to train: validated, its storage reachable, its learner ready."""

    experiment: Experiment
    run_id: str
    storage: Storage
    learner: Learner
    restored: Restored | None = None  # where a resumed run stands
    record: RunRecord | None = None  # a resumed run's record: the MLflow run it continues
    dataset: ExperienceDataset | None = None  # the preset's dataset, found and checked
    dataset_observed: bool = False  # the learner's observation statistics have seen it (a warm start's run read it)
    member: PbtMember | None = None  # a population member's interval: where it pauses
    copy_from: PbtCopy | None = None  # the copy it starts with (an exploit not made yet)

    @property
    def preset(self) -> Preset:
        return self.experiment.preset

    def params(self) -> dict[str, str]:
        """The preset as flat MLflow parameters, secrets redacted."""
        return {key: str(value)[:6000] for key, value in flatten(redacted(self.preset.model_dump(mode="json"))).items()}

    def preset_yaml(self) -> bytes:
        return yaml.safe_dump(redacted(self.preset.model_dump(mode="json")), sort_keys=False).encode()


def prepare_run(experiment: Experiment, warm_start: str | None, resume: str | None,
                run_id: str | None = None, member: PbtMember | None = None) -> PreparedRun:
    """Check the storage (a missing bucket or refused credentials stop here) and the tracking
    server (a refused login or experiment), then make the learner: from scratch, from a
    warm-start policy, or restored from `resume`'s checkpoints (with that run's own preset; a
    population `member` continued with its interval's values). A resumed run that died before
    its first checkpoint starts over, in its own MLflow run. `run_id` names a new run (default:
    preset name and time). The preset's dataset is found and checked here too."""
    experiment = with_block_options(experiment)  # credentials kept in a Prefect block, read here
    storage = ready_storage(storage_location(experiment.preset.storage))
    if resume is None:
        if run_id is not None and has_run_record(storage, run_id):
            raise InvalidPreset("run_id", f"a run {run_id!r} is already under {storage.url('runs')}; "
                                f"continue it with resume={run_id!r}")
        run_id = run_id or new_run_id(experiment.preset.name)
        check_tracking_server(experiment.preset.tracking.tracking_uri, experiment.preset.tracking.experiment)
        dataset = find_dataset(experiment)
        return PreparedRun(experiment, run_id, storage, warm_started(experiment, storage, warm_start), dataset=dataset,
                           dataset_observed=dataset_seen_by_warm_start(storage, warm_start, experiment.preset),
                           member=member)
    record = read_run_record(storage, resume)
    experiment = with_block_options(stored_experiment(storage, resume, experiment, member.settings if member else None))
    check_tracking_server(experiment.preset.tracking.tracking_uri, experiment.preset.tracking.experiment)
    dataset, learner = find_dataset(experiment), create_learner(experiment)
    if member is not None:  # its values from here on, for a resume by hand too
        write_stored_preset(storage, resume, PreparedRun(experiment, resume, storage, learner).preset_yaml())
    if not committed_versions(storage, RunLayout(resume)):
        return PreparedRun(experiment, resume, storage, learner, record=record, dataset=dataset, member=member)
    restored = restore(storage, resume, learner, experiment.preset, dataset)
    copy = member.copy_from if member else None
    copying = copy if copy is not None and restored.state.version == copy.at_version else None  # not made yet
    return PreparedRun(experiment, resume, storage, learner, restored, record, dataset, member=member,
                       copy_from=copying)


def warm_started(experiment: Experiment, storage: Storage, warm_start: str | None) -> Learner:
    """A new run's learner: fresh, from a policy (an MLflow model URI or a policy.safetensors
    path), or a whole learner of a run in the same storage (`learner:RUN_ID`)."""
    from gymflow.tasks.tracking.models import read_warm_start  # MLflow's model code, here only

    if warm_start and warm_start.startswith(LEARNER_WARM_START):
        learner = create_learner(experiment)
        warm_start_learner(learner, storage, warm_start.removeprefix(LEARNER_WARM_START))
        return learner
    weights = read_warm_start(warm_start, experiment.preset.tracking.tracking_uri) if warm_start else None
    return create_learner(experiment, weights)


def dataset_seen_by_warm_start(storage: Storage, warm_start: str | None, preset: Preset) -> bool:
    """A learner warm-started from a run that read this same dataset: its observation statistics
    have seen it already (reading it again would count it twice)."""
    if preset.dataset is None or not (warm_start or "").startswith(LEARNER_WARM_START):
        return False
    run_id, _ = learner_source(warm_start.removeprefix(LEARNER_WARM_START))
    stored = read_stored_preset(storage, run_id).get("dataset")
    return stored is not None and DatasetConfig.model_validate(stored) == preset.dataset


def find_dataset(experiment: Experiment) -> ExperienceDataset | None:
    """The preset's dataset, checked against the env and the learner's memory (None: it has none)."""
    preset = experiment.preset
    if preset.dataset is None:
        return None
    dataset = open_dataset(preset.dataset, preset.storage, experiment.observation_space, experiment.action_space)
    capacity = preset.agent.replay_capacity
    if dataset.steps > capacity:
        raise InvalidPreset("agent.replay_capacity", f"{capacity:,} transitions cannot hold dataset "
                            f"{dataset.name}'s {dataset.steps:,}; allowed: >= {dataset.steps:,}")
    return dataset


@contextmanager
def tracked_run(run: PreparedRun, flow_run_id: str, tags: Mapping[str, str] | None = None,
                alone: bool = True) -> Iterator[Tracker]:
    """The run's MLflow run (a resumed run's own), ended on the way out as FINISHED, FAILED (an
    error) or KILLED (stopped from outside: Ctrl-C, SIGTERM, a Prefect cancellation);
    MLflow reaches artifacts on S3 with the storage's endpoint and credentials. A new run's
    parameters, stored preset and record are written here. `alone`: the run is its process's only
    one (not a sweep's trial, whose sweep records its end): a lost server bounds its final report."""
    resume = f"`{gymflow_command()} resume {run.run_id} --root {run.preset.storage.root}` continues the run"
    with s3_artifact_environment(run.preset.storage.options), \
            prefect_watched(flow_run_id, run.preset.tracking.outage_budget_s, resume) as prefect:
        yield from _tracked(run, flow_run_id, tags or {}, prefect, alone)


def run_tags(overrides: Mapping[str, Any], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Tags that tell a run apart in MLflow's run list: the preset fields it overrode (as
    `key=value` pairs), and `extra` (a sweep trial's)."""
    flat = flatten(overrides)
    changed = " ".join(f"{key}={MASK if is_secret(key) else json.dumps(redacted(value), default=str)}"
                       for key, value in sorted(flat.items()))
    return {"gymflow.overrides": changed[:5000] or "(none)", **(extra or {})}


def preset_tag(run: PreparedRun) -> dict[str, str]:
    """The preset a new run was made from, as `gymflow run` takes it (the run's name is another where
    it learns another env: `myenv-ppo`); a resumed run's MLflow run keeps the tag it has."""
    if run.record is not None:
        return {}
    return {"gymflow.preset": run.experiment.source or run.preset.name}


def _tracked(run: PreparedRun, flow_run_id: str, extra_tags: Mapping[str, str], prefect: Outage | None,
             alone: bool) -> Iterator[Tracker]:
    tracking = run.preset.tracking
    tags = {**source_tags(), RETURN_TAG: NOT_EVALUATED,  # the first tag a run's page shows (tasks/tracking/pages.py)
            "gymflow.run_id": run.run_id, "prefect.flow_run_id": flow_run_id, "gymflow.env": run.preset.env.id,
            "gymflow.env_backend": rollout_backend(run.preset), **preset_tag(run), **extra_tags}
    try:
        tracker = Tracker(tracking.tracking_uri, tracking.experiment, run_name=run.run_id, tags=tags,
                          existing_run_id=run.record.mlflow_run_id if run.record else None,
                          options=TrackerOptions.of(tracking))
    except Exception as error:  # a server's refusal (a user who may read the experiment, not run in it): one line
        if (refusal := refusal_of(error, tracking.tracking_uri, tracking.experiment)) is not None:
            raise refusal from None
        raise
    began(run.run_id)  # from here on the run has written something: its log stays whatever ends it
    tracker.prefect_outage = prefect  # the Prefect API's, watched beside MLflow's (tasks/tracking/prefect_watch.py)
    status = "FINISHED"
    try:
        # a deadline that ends the process (a lost server: gymflow.last_steps) ends the MLflow run first
        with before_exit_now(partial(tracker.finish, "FAILED")):
            if run.record is None:
                tracker.log_params(run.params())
                write_stored_preset(run.storage, run.run_id, run.preset_yaml())
                record = RunRecord(tracker.run_id, tracking.experiment, redacted_uri(tracking.tracking_uri))
                write_run_record(run.storage, run.run_id, record)
            yield tracker
    except ServerLost as lost:  # a server it records to: the run stops at the commit after its budget ran out
        status = "FAILED"
        if prefect is None or prefect.lost is None:  # its events go to the Prefect API
            RunEvents(run.run_id, run.preset.name, tracker.run_id).failed(lost)
        said = lost if lost.field == STORE_FIELD else ServerLost(  # the store's names the command that continues it
            lost.field, f"{lost.problem}; what was committed stays (and what MLflow did not get, beside it): "
            f"`{gymflow_command()} resume {run.run_id} --root {run.preset.storage.root}` continues the run once the "
            "server answers")
        # what is left is Prefect's engine reporting the run's end, which it tries again for minutes
        # against an API that answers 500: bounded (the line said, the process ended) past its grace
        if alone:
            end_within(FINAL_REPORT_GRACE_S, f"gymflow: error: {said}")
        if said is lost:
            raise
        raise said from None
    except BaseException as ended:  # KeyboardInterrupt, Prefect's TerminationSignal: a stop, not an error
        status = "FAILED" if isinstance(ended, Exception) else "KILLED"
        RunEvents(run.run_id, run.preset.name, tracker.run_id).failed(ended)
        raise
    finally:
        with held("the MLflow run's last state"):
            tracker.finish(status)


def run_recorder(run: PreparedRun, tracker: Tracker, logger: AnyLogger) -> RunRecorder:
    budget, total = Budget.of(run.preset), planned_total(run.preset)
    if total != budget.total and run.restored is None:
        logger.info("run %s: %s %s in whole rounds of %s: %s in all", run.run_id, f"{budget.total:,}", budget.unit,
                    f"{run.preset.env_steps_per_iteration:,}", f"{total:,}")
    progress = ProgressLog(logger, total, views=[ProgressArtifact(run.run_id, prefect=tracker.prefect_outage)],
                           unit=budget.unit)
    backlog = RunLayout(run.run_id).tracking_backlog
    recorder = RunRecorder.resumed(tracker, progress, budget, run.storage, backlog) if run.restored else \
        RunRecorder(tracker, progress, budget, run.storage, backlog_key=backlog)
    preset = run.preset
    recorder.shows_training_return = not preset.offline and preset.schedule.evaluation_opponent != "random"
    recorder.events = RunEvents(run.run_id, preset.name, tracker.run_id)
    recorder.system = SystemMetrics(tracker)
    recorder.env_words = f"env.id: {preset.env.id!r} (observation_space {run.experiment.observation_space})"
    return recorder


@contextmanager
def improve_loop(run: PreparedRun, hosts: Hosts, observer: Observer, logger: AnyLogger,
                 early_stop: EarlyStop | None = None, earlier: Sequence[EvaluationRow] = ()) -> Iterator[ImproveLoop]:
    """The run's loop: SYNC rounds or the ASYNC stream, evaluations beside the learner, commits,
    the stop rule (with an outside judge that may end it early, a sweep's pruner). A resumed run's
    best evaluated version is found among its `earlier` evaluations. On the way out the evaluation
    thread ends; on an error, what is in flight is given up."""
    preset, budget = run.preset, Budget.of(run.preset)
    # a collect-only run's shards are what it makes: all kept
    keeping = preset.storage.model_copy(update={"keep_shards": "all"}) if preset.collect_only else preset.storage
    devices = rank_devices(preset, run.experiment.observation_space)
    with gpu_slots(devices, logger, run=run.run_id, wait_s=preset.distribution.gpu_wait_s), \
            learner_ranks(run, devices, logger) as ranks, inference_for_workers(run, observer, logger) as inference:
        plan = RoundPlan(preset, run.run_id, inference)
        evaluations = EvaluationSchedule(hosts.for_evaluations(), plan, budget,
                                         blocking=preset.distribution.mode != "async", logger=logger)
        commits = Commits(run.storage, run.run_id, keeping, policy_window=preset.distribution.max_policy_lag + 1,
                          budget=budget, pool=preset.schedule.opponent_pool)
        loop = ImproveLoop(
            run.learner, _collection(run, hosts, plan, logger), evaluations, commits,
            StopRule(budget, preset.schedule.target_return, early_stop, run.member.pause_at if run.member else None),
            observer,
        )
        loop.ranks = ranks
        if run.restored is not None:  # its best evaluated version, from before its stop
            loop.best = best_stored(earlier, run.restored.state.version, commits.published)
        loop.commits.pinnable = run.member is not None
        try:
            yield loop
        except BaseException:
            loop.collection.cancel()
            raise
        finally:
            evaluations.close()
            loop.commits.close()


@contextmanager
def learner_ranks(run: PreparedRun, devices: Sequence[str], logger: AnyLogger) -> Iterator[LearnerRanks | None]:
    """The learner's other ranks, beside the flow's process, while inside (distribution.learners > 1)."""
    if len(devices) == 1:
        yield None
        return
    ranks = LearnerRanks(run.learner, run.preset, devices, logger)
    logger.info("learning on %d ranks (%s)", ranks.world, ", ".join(devices))
    try:
        yield ranks
    finally:
        ranks.close()


@contextmanager
def inference_for_workers(run: PreparedRun, observer: Observer, logger: AnyLogger
                          ) -> Iterator[InferenceAddress | None]:
    """The server beside the learner that computes the rollout workers' network outputs
    (distribution.inference), or None: the workers act on their CPU. What it served is logged as
    it closes."""
    preset, experiment = run.preset, run.experiment
    device = learner_device(preset, experiment.observation_space)
    if not inference_beside_learner(preset, device):
        yield None
        return
    try:
        server = InferenceServer.start(storage_location(preset.storage), run.run_id, preset.agent,
                                       (experiment.observation_space, experiment.action_space), device)
    except InferenceUnavailable as error:
        logger.warning("distribution.inference: %s; the rollout workers act on their CPU", error)
        yield None
        return
    try:
        yield server.address
    finally:
        served = server.close()
        log = logger.warning if served.problem else logger.info
        log("inference beside the learner (%s): %s requests, %.1f rows a forward%s%s", device,
            f"{served.requests:,}", served.metrics()["inference/rows_per_forward"],
            f", {served.failed:,} not served, {served.refused} clients turned away" if served.failed or served.refused
            else "", f"; {served.problem}" if served.problem else "")
        observer.served(served.metrics())


def best_stored(rows: Sequence[EvaluationRow], up_to: int, stored: Container[int]) -> Standing | None:
    """The best of a resumed run's evaluations (the later of equals) of versions up to the one it
    continues from whose policies are still stored."""
    kept = [row for row in rows if row.version is not None and row.version <= up_to and row.version in stored
            and row.mean == row.mean]
    best = max(reversed(kept), key=lambda row: row.mean, default=None)  # max keeps the first of equals: the later
    return None if best is None else Standing(best.version, best.env_steps, best.mean)


def first_state(run: PreparedRun, hosts: Hosts, loop: ImproveLoop, logger: AnyLogger) -> LoopState:
    """Where training starts: a resumed run's state, or the dataset and heatup in the replay
    memory (off-policy agents) and version 0."""
    if run.restored is not None:
        loop.commits.resumed(run.learner, run.restored.state)
        return run.restored.state if run.copy_from is None else exploit(run, loop, logger)
    plan, learner = RoundPlan(run.preset, run.run_id), run.learner
    if run.dataset is not None:
        assert isinstance(learner, ReplayLearner)  # presets/validate.py refuses a dataset for on-policy agents
        read_dataset(run.dataset, learner, logger, observed=run.dataset_observed)
    if isinstance(learner, ReplayLearner) and run.preset.schedule.heatup_env_steps:
        state = heatup(hosts, plan, learner, run.storage, logger)
    else:
        state = LoopState.start(plan.workers, Budget.of(run.preset).evaluate_every)
    loop.commit(state)
    return state


def say_where_it_starts(run: PreparedRun, state: LoopState, recorder: RunRecorder, logger: AnyLogger) -> None:
    """A resumed run says from which version and env step it continues, and its bar starts there;
    a population member's values for the interval are logged at that step."""
    spent, unit = recorder.budget.spent(state), recorder.budget.unit
    if run.restored is not None:
        logger.info("run %s continues from v%d at %s %s", run.run_id, state.version, f"{spent:,}", unit)
        recorder.progress.update(spent, f"continues from v{state.version}", force=True)
    if run.member is not None:
        log_member_interval(recorder.tracker, run.member, spent)


def exploit(run: PreparedRun, loop: ImproveLoop, logger: AnyLogger) -> LoopState:
    """A population member takes another's learner as that one paused (weights, optimiser moments,
    observation statistics, an off-policy member's replay memory; its own RNG streams, counters and
    the values it now trains with), as a version of its own, checkpointed at once; then the
    source's checkpoint is let go."""
    copy, paused = run.copy_from, run.restored.state
    warm_start_learner(run.learner, run.storage, f"{copy.source_run_id}@v{copy.version}")
    if isinstance(run.learner, ReplayLearner):
        copy_replay_memory(run.learner, run.storage, copy.source_run_id, copy.version)
    state = replace(paused, version=paused.version + 1)  # the copy, at the env steps where the member paused
    loop.commit(state, checkpoint=True)
    run.storage.delete([RunLayout(copy.source_run_id).pin(copy.version, run.run_id)])
    logger.info("run %s copies member %d's learner (%s v%d) as v%d", run.run_id, copy.source, copy.source_run_id,
                copy.version, state.version)
    return state


def storage_url(run: PreparedRun) -> str:
    return run.storage.url(RunLayout(run.run_id).prefix)


def _collection(run: PreparedRun, hosts: Hosts, plan: RoundPlan, logger: AnyLogger) -> Collection:
    preset, learner = run.preset, run.learner
    exploration = partial(run.experiment.algorithm.exploration, preset.agent)
    rebuilt_from_shards = isinstance(learner, ReplayLearner) and not preset.storage.checkpoint_replay \
        and not preset.collect_only
    replay_window = learner.replay.capacity if rebuilt_from_shards else 0
    if preset.offline:
        return OfflineSteps(plan.workers, preset.agent.train_steps_per_iteration)
    if preset.distribution.mode != "async":  # single runs sync's rounds in this process
        return SyncRounds(hosts, plan, exploration, logger, replay_window)
    if not isinstance(learner, ReplayLearner):  # APPO, IMPALA: a batch as it lands, a chunk from each worker
        return BatchStream(hosts, plan, Batches(preset.env_steps_per_iteration, preset.distribution.max_policy_lag),
                           exploration, logger)
    ratio = Ratio(preset.samples_per_insert, learner.samples_per_train_step,
                  preset.distribution.commit_every_train_steps, preset.distribution.max_policy_lag)
    return AsyncStream(hosts, plan, ratio, exploration, logger, replay_window)
