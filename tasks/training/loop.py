"""The improve loop's stages, as the flow calls them: heatup, then training in steps of
collect -> learn -> commit -> maybe evaluate until the stop rule says so, then the last
evaluation.

`ImproveLoop.step` is one step, the same for SYNC rounds and the ASYNC stream (they differ only
in their `Collection`). Steps run inside `train` Prefect tasks of about `TASK_SECONDS` each,
because a Prefect task run costs ~20 ms here (its engine in the flow's process, its states and
events in the API server, on the same two cores): a task a round was a quarter of a CartPole
run's wall-clock (docs/benchmarks.md).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE

from gymflow.agents.core import Learner, ReplayLearner
from gymflow.logs import AnyLogger
from gymflow.stops import end_if_stopped
from gymflow.tasks.cluster.host_figures import node_id
from gymflow.tasks.cluster.hosts import Hosts
from gymflow.tasks.cluster.messages import EvaluationResult
from gymflow.tasks.cluster.rounds import RoundPlan, collect_round
from gymflow.tasks.lake.source import ExperienceDataset
from gymflow.tasks.storage.objects import Storage
from gymflow.tasks.storage.shards import ShardRef, read_shard
from gymflow.tasks.tracking.plots import GRADIENT_STEPS
from gymflow.tasks.training.collection import Collection, Experience
from gymflow.tasks.training.commits import Commits, InUse
from gymflow.tasks.training.evaluation import EvaluationSchedule, Scored, Standing
from gymflow.tasks.training.learning import Learned, learn
from gymflow.tasks.training.state import Budget, LoopState

if TYPE_CHECKING:
    from gymflow.tasks.training.learner_ranks import LearnerRanks

TASK_SECONDS = 2.0  # the training one `train` task run carries


class EarlyStop(Protocol):
    """An outside judge of evaluations (a sweep's pruner) that may end a run early."""

    def should_stop(self, evaluation: Scored) -> bool: ...


@dataclass(frozen=True)
class StopRule:
    """Training stops once the budget is spent (env steps collected and learned from; an offline
    run's gradient steps), once an evaluation reaches the target return, or once the early-stop
    judge says so; it pauses at `pause_at` on the run's clock (a population member at its
    interval's end, continued later as a resume)."""

    budget: Budget
    target_return: float | None
    early_stop: EarlyStop | None = None
    pause_at: int | None = None

    def reached(self, state: LoopState, drained: bool, latest: Scored | None) -> bool:
        budget_spent = self.budget.spent(state) >= self.budget.total and drained
        return budget_spent or self.target_reached(latest) or self.stopped_early(latest) or self.paused(state, drained)

    def paused(self, state: LoopState, drained: bool = True) -> bool:
        """At the pause, with the budget not spent: the run is to be continued."""
        spent = self.budget.spent(state)
        return self.pause_at is not None and self.pause_at <= spent < self.budget.total and drained

    def stopped_early(self, evaluation: Scored | None) -> bool:
        return self.early_stop is not None and evaluation is not None and self.early_stop.should_stop(evaluation)

    def target_reached(self, evaluation: Scored | None) -> bool:
        if self.target_return is None or evaluation is None:
            return False
        return evaluation.mean_return >= self.target_return


@dataclass(frozen=True)
class StepReport:
    """What one step did: logged to MLflow, shown as progress, summed into the run's summary."""

    state: LoopState  # what the step's commit commits
    metrics: dict[str, float]  # namespaced: rollout/, train/, async/, time/ (the round's timings come with its commit)
    work_seconds: float  # stepping envs, learning, an evaluation waited for: the step's critical path
    collected_by: frozenset[str]  # host:pid of the processes whose shards landed
    hosts: dict[str, dict[str, float]] = field(default_factory=dict)  # worker node -> its machine's figures
    observations_outside: str | None = None  # where a landed shard's observations left their space (envs/steps.py)


class Commit(NamedTuple):
    seconds: float  # publishing the policy, and checkpointing it when due


class Finished(NamedTuple):
    state: LoopState  # after what was in flight landed
    deciding: Scored  # the evaluation that decides whether the run reached its target: the last version's
    delivered: Standing  # the version delivered: the best evaluated (at a population member's pause, the last)


class Observer(Protocol):
    """Told of everything the loop does (the flow records it in MLflow and shows progress)."""

    def stepped(self, report: StepReport) -> None:
        """A step learned; told before its version is committed."""
        ...

    def committed(self, state: LoopState, timings: dict[str, float]) -> None:
        """The step's version is committed; `timings`: the round's, its commit's included."""
        ...

    def settle(self) -> None:
        """Make durable what it was told so far: called before a checkpoint is committed, since a
        run resumed from that checkpoint does not tell it again."""
        ...

    def evaluated(self, scored: Scored, waited: bool = False) -> None:
        """An evaluation finished; `waited`: the run waited for it, so its time is work."""
        ...

    def filmed(self, scored: Scored) -> None:
        """A film of a version that was already evaluated (`scored.result.film`)."""
        ...

    def served(self, metrics: dict[str, float]) -> None:
        """Figures of what served the run's workers as it closes (inference beside the learner)."""
        ...


class ImproveLoop:
    """The train stage of one run: its learner, where experience comes from, when evaluations
    run, where versions are committed, when to stop, and who is told."""

    def __init__(self, learner: Learner, collection: Collection, evaluations: EvaluationSchedule,
                 commits: Commits, stop: StopRule, observer: Observer):
        self.learner, self.collection, self.evaluations = learner, collection, evaluations
        self.ranks: LearnerRanks | None = None  # the learner's other ranks beside this process (distribution.learners)
        self.commits, self.stop, self.observer = commits, stop, observer
        self.latest: Scored | None = None  # the newest evaluation that finished
        self.best: Standing | None = None  # the best evaluated version so far (a resumed run's: from before its stop)
        self._film: tuple[Future[EvaluationResult], int] | None = None  # the deciding version's, with its clock

    def step(self, state: LoopState) -> LoopState:
        """collect -> learn -> commit -> maybe evaluate; returns the state after the commit."""
        end_if_stopped()  # a sweep's run, in a thread of its own: the command was stopped
        started = time.perf_counter()
        experience = self.collection.collect(state)
        next_evaluation = self.evaluations.start_if_due(state)  # scores version v while the learner learns
        learned = learn(self.learner, self.commits.storage, experience, self._progress(state), self.ranks)
        committed = experience.state.committed(next_evaluation)
        evaluation = self.evaluations.finished()
        self.latest = evaluation or self.latest
        waited = evaluation.result.seconds if evaluation is not None and self.evaluations.blocking else 0.0
        report = _report(experience, learned, committed, waited)
        if self.ranks is not None:
            report.hosts.update(self.ranks.figures())
        if self.stop.budget.offline:  # the learning curve's axis
            report.metrics[GRADIENT_STEPS] = float(self.stop.budget.spent(committed))
        # told before the commit: a checkpoint is committed only once what led to it is recorded
        self.observer.stepped(report)
        if evaluation is not None:
            self.observer.evaluated(evaluation)
            self._saw(evaluation)
        commit = self.commit(committed)
        self.observer.committed(committed, _timings(experience, commit, time.perf_counter() - started))
        return committed

    def commit(self, state: LoopState, checkpoint: bool = False) -> Commit:
        """Commit `state.version` (tasks/training/commits.py), keeping what the run may still read;
        checkpointed when due, at the end, or when asked (`checkpoint`)."""
        started = time.perf_counter()
        latest = self.latest.version if self.latest else None
        in_use = InUse(self.evaluations.scoring(), latest, latest if self.stop.target_reached(self.latest) else None,
                       self.best.version if self.best else None)
        self.commits.commit(self.learner, state, in_use, checkpoint or self.stopped(state),
                            self.collection.checkpointed, before_checkpoint=self.observer.settle)
        return Commit(time.perf_counter() - started)

    def stopped(self, state: LoopState) -> bool:
        return self.stop.reached(state, self.collection.drained(), self.latest)

    def finish(self, state: LoopState) -> Finished:
        """After the last step: what is in flight lands, an evaluation still running is waited
        for, and the evaluation that decides the run is found: a periodic one that reached the
        target, else the last version's, run now. The version delivered is the best evaluated one
        (the later of equals); a population member paused to be continued delivers its last. Where
        the preset films the final evaluation, the delivered version's film starts beside what the
        caller does next; `film_landed` waits for it."""
        state = self.collection.finish(state)
        late = self.evaluations.wait()
        if late is not None:
            self.observer.evaluated(late)
            self._saw(late)
        deciding = self._deciding(state, late)
        self._saw(deciding)
        paused = self.paused(state, deciding)
        delivered = deciding.standing() if paused or self.best is None else self.best
        if not delivered.filmed and self.evaluations.films_final and not paused:
            self._film = (self.evaluations.film(delivered.version), delivered.step)
        return Finished(state, deciding, delivered)

    def _saw(self, scored: Scored) -> None:
        """Keep the best evaluated version: the later of equal scores (a run's evaluations often tie at the
        env's cap); one whose return is not a number is never the best."""
        if scored.mean_return == scored.mean_return and (self.best is None or
                                                           scored.mean_return >= self.best.mean_return):
            self.best = scored.standing()

    def paused(self, state: LoopState, deciding: Scored) -> bool:
        """Finished at a pause (a population member's interval's end), not at its target: to be continued."""
        return self.stop.paused(state) and not self.stop.target_reached(deciding)

    def _deciding(self, state: LoopState, late: Scored | None) -> Scored:
        if self.stop.target_reached(self.latest):
            return self.latest
        if late is not None and self.stop.target_reached(late) and late.version == state.version:
            return late
        deciding = self.evaluations.score_now(state)
        self.observer.evaluated(deciding, waited=True)
        return deciding

    def film_landed(self) -> None:
        """Wait for the film `finish` started, and hand it to the observer."""
        if self._film is not None:
            future, step = self._film
            self._film = None
            self.observer.filmed(Scored(step, self.evaluations.result_of(future)))

    def _progress(self, state: LoopState) -> float:
        return min(self.stop.budget.spent(state) / self.stop.budget.total, 1.0)


@task(name="train", task_run_name="train-from-v{state.version}", cache_policy=NO_CACHE)
def train(loop: ImproveLoop, state: LoopState, seconds: float = TASK_SECONDS) -> LoopState:
    """Steps of the loop one after another for about `seconds`, or until it should stop."""
    started = time.perf_counter()
    while True:
        state = loop.step(state)
        if loop.stopped(state) or time.perf_counter() - started >= seconds:
            return state


@task(name="read-dataset", task_run_name="read-dataset", cache_policy=NO_CACHE)
def read_dataset(dataset: ExperienceDataset, learner: ReplayLearner, logger: AnyLogger, observed: bool = False
                 ) -> None:
    """Put the dataset's transitions in the replay memory, in its order, before anything is
    collected (an offline run's whole experience); `observed`: the memory alone, the learner's
    observation statistics having seen them."""
    for rollout in dataset.rollouts():
        if observed:
            learner.replay.add(rollout)
        else:
            learner.insert([rollout])
    logger.info("dataset %s: %s episodes, %s transitions in replay (%s)", dataset.name,
                f"{dataset.episodes:,}", f"{len(learner.replay):,}", dataset.url)


@task(name="heatup", task_run_name="heatup", cache_policy=NO_CACHE)
def heatup(hosts: Hosts, plan: RoundPlan, learner: ReplayLearner, storage: Storage, logger: AnyLogger) -> LoopState:
    """Fill the replay memory from one round of a uniform random policy, one shard a worker;
    no learning. Its env steps count against the budget."""
    state = LoopState.start(plan.workers, plan.preset.schedule.evaluate_every_env_steps)
    shards = collect_round(hosts, plan.rollouts(None, 1.0, state.env_cursors), logger)
    learner.insert([read_shard(storage, shard) for shard in shards])
    logger.info("heatup: %s random-policy env steps in replay", f"{len(learner.replay):,}")
    return replace(state, env_steps=sum(shard.env_steps for shard in shards),
                   env_cursors=tuple(shard.key for shard in shards))


def _report(experience: Experience, learned: Learned, state: LoopState, evaluation_seconds: float) -> StepReport:
    metrics = experience.metrics | rollout_metrics(experience.landed) | {
        f"train/{name}": value for name, value in learned.metrics.items()
    } | {
        "time/env_steps": float(state.env_steps),
        "time/policy_version": float(state.version),
        "time/collect_seconds": experience.collect_seconds,
        "time/learn_seconds": learned.seconds,
    }
    work = experience.collect_seconds + max(learned.seconds, evaluation_seconds)
    hosts = {node_id("worker", shard.collected_by): dict(shard.host) for shard in experience.landed if shard.host}
    outside = next((shard.observations_outside for shard in experience.landed if shard.observations_outside), None)
    return StepReport(state, metrics, work, frozenset(shard.collected_by for shard in experience.landed), hosts,
                      outside)


def _timings(experience: Experience, commit: Commit, seconds: float) -> dict[str, float]:
    """The round's timings, its commit's included."""
    return {
        "time/env_steps_per_second": sum(shard.env_steps for shard in experience.landed) / seconds,
        "time/round_seconds": seconds,
        "time/commit_seconds": commit.seconds,  # publishing the policy, and a checkpoint when one is due
    }


def rollout_metrics(landed: tuple[ShardRef, ...]) -> dict[str, float]:
    """What the shards that landed in one step say about the episodes that ended in them."""
    returns = [r for shard in landed for r in shard.episode_returns]
    lengths = [n for shard in landed for n in shard.episode_lengths]
    metrics = {"rollout/episodes": float(len(returns)), "rollout/shards": float(len(landed)),
               "rollout/shard_megabytes": sum(shard.size for shard in landed) / 1e6}
    if landed:
        metrics["rollout/shard_bytes_per_step"] = sum(s.size for s in landed) / max(sum(s.env_steps for s in landed), 1)
    if returns:
        metrics["rollout/episode_return_mean"] = float(np.mean(returns))
        metrics["rollout/episode_length_mean"] = float(np.mean(lengths))
    return metrics
