"""What a run reports: recorded step by step as the loop runs (MLflow metrics, progress), and
summed up once it is over. The report describes the loop; it never steers it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from gymflow.envs.steps import SAMPLED_EVERY
from gymflow.tasks.storage.objects import Storage
from gymflow.tasks.tracking.events import RunEvents
from gymflow.tasks.tracking.pages import RETURN_TAG, return_words
from gymflow.tasks.tracking.plots import PLOTTED_METRICS
from gymflow.tasks.tracking.progress import ProgressLog
from gymflow.tasks.tracking.system_metrics import SystemMetrics
from gymflow.tasks.tracking.tracker import Tracker, Unsent
from gymflow.tasks.training.evaluation import Scored, Standing
from gymflow.tasks.training.ledger import Ledger
from gymflow.tasks.training.loop import Finished, StepReport
from gymflow.tasks.training.state import Budget, LoopState


class EvaluationRow(NamedTuple):
    env_steps: int  # the run's clock: env steps collected (an offline run's: gradient steps)
    mean: float
    low: float
    high: float
    version: int | None = None  # the policy version scored (None: a run logged before it was recorded)


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    mlflow_run_id: str
    storage_url: str
    env_steps: int = 0
    versions_committed: int = 0
    delivered_version: int = 0  # the best evaluated version (a paused member's: its last), logged as the model
    model_uri: str = ""  # the delivered policy as an MLflow logged model (models:/<model id>)
    final_return: float | None = None  # the delivered version's evaluation return
    best_return: float | None = None
    solved: bool = False
    flow_run_id: str = ""  # the Prefect flow run that trained it
    stopped_early: bool = False  # a sweep's pruner ended it before its budget
    wall_seconds: float = 0.0
    work_seconds: float = 0.0  # stepping envs with the policy, learning, evaluating (critical path)
    evaluations: tuple[EvaluationRow, ...] = ()
    rollout_processes: frozenset[str] = frozenset()  # host:pid of every process that collected
    shards_inserted: int = 0  # async: shards inserted into replay
    shards_dropped: int = 0  # async: shards dropped by the policy-lag bound
    shards_unused: int = 0  # async: shards that landed after the stop
    policy_lag_mean: float = 0.0  # async: learner version minus the shard's, over every landed shard
    policy_lag_max: int = 0
    gradient_steps: int | None = None  # an offline run's budget spent (it collects no env steps)
    target_return: float | None = None  # the preset's schedule.target_return: None, a run without one
    paused: bool = False  # a population member at its interval's end, checkpointed, to be continued
    last: Standing | None = None  # the last version's evaluation, where another version is delivered
    mlflow_page: str = ""  # where to see the run in MLflow's UI (tasks/tracking/pages.py), once delivered

    @property
    def clock(self) -> int:
        """Where the run's clock stopped: env steps, or an offline run's gradient steps."""
        return self.env_steps if self.gradient_steps is None else self.gradient_steps

    @property
    def orchestration_share(self) -> float:
        """The share of the training loop's wall-clock not spent stepping envs or learning."""
        return 1.0 - self.work_seconds / self.wall_seconds if self.wall_seconds else 0.0


CURVE_POINTS = 2_000
FILMS = "videos"  # the MLflow run's folder of evaluation films
_CURVE_KEYS = frozenset((*PLOTTED_METRICS, "time/env_steps"))


@dataclass
class RunRecorder:
    """The loop's observer: logs each step and evaluation to MLflow, shows progress, and keeps
    what the summary and the learning curve are made of. A resumed run starts from what MLflow
    already holds."""

    tracker: Tracker
    progress: ProgressLog
    budget: Budget  # the run's clock: the step its metrics are logged at
    storage: Storage | None = None  # where the rollout workers put evaluation films
    history: list[dict[str, float]] = field(default_factory=list)
    evaluations: list[EvaluationRow] = field(default_factory=list)
    work_seconds: float = 0.0
    processes: set[str] = field(default_factory=set)
    films: list[str] = field(default_factory=list)  # MLflow artifact paths of the evaluation films
    # the progress line's training return: not offline (no episodes), not a competitive game's (sides cancel out)
    shows_training_return: bool = True
    events: RunEvents | None = None  # Prefect events of its evaluations and its end
    system: SystemMetrics | None = None  # per node: CPU, memory, GPU
    backlog_key: str | None = None  # where what MLflow has not got is kept at a commit (RunLayout.tracking_backlog)
    env_words: str = "the env"  # the env and its observation space, as a line about its observations names them
    _backlog_kept: bool = False
    _said_outside: bool = False
    _episode_return: float = float("nan")
    _step: int = 0  # the newest step logged

    @classmethod
    def resumed(cls, tracker: Tracker, progress: ProgressLog, budget: Budget, storage: Storage | None = None,
                backlog_key: str | None = None) -> RunRecorder:
        """The recorder of a resumed run: what MLflow had not got from its last process sent first."""
        if storage is not None and backlog_key is not None and storage.exists(backlog_key):
            tracker.send_again(Unsent.from_json(storage.read(backlog_key)), storage.read)
            storage.delete([backlog_key])
        recorder = cls(tracker, progress, budget, storage, backlog_key=backlog_key,
                       evaluations=[EvaluationRow(*row) for row in tracker.evaluation_rows()])
        for row in tracker.metric_rows(PLOTTED_METRICS):
            recorder._keep_for_curve(row)
        return recorder

    def stepped(self, report: StepReport) -> None:
        self._step = self.budget.spent(report.state)
        self.tracker.log_metrics(report.metrics, step=self._step)
        if self.system is not None:
            self.system.record(report.hosts, self._step)
        self._keep_for_curve(report.metrics)
        self.work_seconds += report.work_seconds
        self.processes |= report.collected_by
        self._episode_return = report.metrics.get("rollout/episode_return_mean", self._episode_return)
        if report.observations_outside and not self._said_outside:  # once a run: the env's, not the run's, to mend
            self._said_outside = True
            self.progress.logger.warning("%s returned observations outside the bounds it declares: %s (one step in "
                                         "%d checked); training goes on with them as they are", self.env_words,
                                         report.observations_outside, SAMPLED_EVERY)
        self.progress.update(self.budget.spent(report.state), self._status(report.state))

    def committed(self, state: LoopState, timings: dict[str, float]) -> None:
        """After the commit: a server it records to lost for good stops the run here, its checkpoint made."""
        self.tracker.outage.check()
        if self.tracker.prefect_outage is not None:
            self.tracker.prefect_outage.check()
        step = self.budget.spent(state)
        self.tracker.log_metrics(timings, step=step)
        if self.history and self._step == step:  # the curve's point of the step just told (throughput is a timing)
            self.history[-1].update({key: value for key, value in timings.items() if key in _CURVE_KEYS})

    def settle(self) -> None:
        """What a resume from the checkpoint about to be committed will not log again is written now;
        while the tracking server does not answer, kept in storage instead (training goes on, and a
        resume sends it)."""
        if self.storage is None or self.backlog_key is None:
            self.tracker.flush()
            return
        if self.tracker.written_or_out():
            self._forget_backlog()
            return
        if unsent := self.tracker.unsent():
            self.storage.write(self.backlog_key, unsent.to_json())
            self._backlog_kept = True

    def _forget_backlog(self) -> None:
        if self._backlog_kept and self.storage is not None and self.backlog_key is not None:
            self.storage.delete([self.backlog_key])
            self._backlog_kept = False

    def evaluated(self, scored: Scored, waited: bool = False) -> None:
        self.tracker.log_metrics(scored.metrics(), step=scored.step)
        returns = scored.result.returns
        # a run killed after an evaluation was logged and resumed from the checkpoint at that step
        # evaluates the same step again (the same version): one row, as MLflow keeps one value a step
        self.evaluations = [row for row in self.evaluations if row.env_steps != scored.step]
        self.evaluations.append(EvaluationRow(scored.step, scored.mean_return, min(returns), max(returns),
                                              scored.version))
        best = max(row.mean for row in self.evaluations)
        self.tracker.tag_later({RETURN_TAG: return_words(scored.mean_return, scored.version, best)})
        if self.events is not None:
            self.events.evaluated(scored.step, scored.version, scored.mean_return, min(returns), max(returns))
        self.work_seconds += scored.result.seconds if waited else 0.0
        self._log_film(scored)

    def filmed(self, scored: Scored) -> None:
        self._log_film(scored)

    def served(self, metrics: dict[str, float]) -> None:
        self.tracker.log_metrics(metrics, step=self._step)

    def _log_film(self, scored: Scored) -> None:
        film, name = scored.result.film, f"evaluation-v{scored.version:06d}.mp4"
        if scored.result.no_film:
            self.progress.logger.info("no video of v%d: %s", scored.version, scored.result.no_film)
        if film is None or self.storage is None:
            return
        self.tracker.log_bytes(self.storage.read(film.key), FILMS, name, source=film.key)
        self.films.append(f"{FILMS}/{name}")

    def _keep_for_curve(self, metrics: dict[str, float]) -> None:
        """The learning curve's points: the plotted metrics of each step, thinned to every other
        point whenever they pass 2 x CURVE_POINTS, so a run of any length holds a bounded history."""
        self.history.append({key: value for key, value in metrics.items() if key in _CURVE_KEYS})
        if len(self.history) > 2 * CURVE_POINTS:
            self.history = self.history[::-2][::-1]  # the newest point stays

    def _status(self, state: LoopState) -> str:
        shown = self.shows_training_return and self._episode_return == self._episode_return  # not nan
        status = f"v{state.version} return {self._episode_return:.1f}" if shown else f"v{state.version}"
        return f"{status} eval {self.evaluations[-1].mean:.1f}" if self.evaluations else status


@dataclass(frozen=True)
class RunIdentity:
    run_id: str
    mlflow_run_id: str
    storage_url: str
    flow_run_id: str = ""  # the Prefect flow run's id


class RunEnding(NamedTuple):
    solved: bool  # the deciding evaluation reached the target return
    stopped_early: bool  # the early-stop judge (a sweep's pruner) ended it
    wall_seconds: float  # of the training loop
    target_return: float | None = None  # what `solved` was judged against (None: no target)
    paused: bool = False  # at a population member's pause: to be continued


def summarize(identity: RunIdentity, finished: Finished, recorder: RunRecorder, ending: RunEnding) -> RunSummary:
    """The run's report, from the loop's final state and what was recorded along the way."""
    state, delivered, last = finished.state, finished.delivered, finished.deciding.standing()
    ledger = state.stream.ledger if state.stream else Ledger()
    return RunSummary(
        identity.run_id, identity.mlflow_run_id, identity.storage_url,
        env_steps=state.env_steps, versions_committed=state.version + 1, delivered_version=delivered.version,
        final_return=delivered.mean_return, best_return=max(row.mean for row in recorder.evaluations),
        solved=ending.solved, flow_run_id=identity.flow_run_id, stopped_early=ending.stopped_early,
        wall_seconds=ending.wall_seconds,
        work_seconds=recorder.work_seconds, evaluations=tuple(recorder.evaluations),
        rollout_processes=frozenset(recorder.processes), shards_inserted=ledger.shards_inserted,
        shards_dropped=ledger.shards_dropped, shards_unused=ledger.shards_unused,
        policy_lag_mean=ledger.lag_mean, policy_lag_max=ledger.lag_max,
        gradient_steps=recorder.budget.spent(state) if recorder.budget.offline else None,
        target_return=ending.target_return, paused=ending.paused,
        last=None if last.version == delivered.version else last,
    )
