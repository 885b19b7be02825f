"""When and how the greedy policy is scored: every `evaluate_every_env_steps` (offline runs:
`evaluate_every_train_steps`), one evaluation at
a time, on the rollout workers beside the learner (a thread of the flow's process waits for it),
so it does not stall training; and once more at the end. Inside a flow run each evaluation is a
Prefect task run named by the version it scores (`evaluate-v12`).

SYNC rounds wait for the evaluation that ran beside their learning step, so a run stops at the
same version on every try; the ASYNC stream only picks up evaluations that have finished.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State
from prefect.states import Cancelled

from gymflow.logs import AnyLogger
from gymflow.stops import stopped
from gymflow.tasks.cluster.hosts import Hosts
from gymflow.tasks.cluster.messages import EvaluationResult
from gymflow.tasks.cluster.rounds import RoundPlan, evaluate_version
from gymflow.tasks.training.state import Budget, LoopState

QUEUED_JOBS_POLL_S = 0.01  # how often a caller waiting for an evaluation looks for its jobs still queued


class Standing(NamedTuple):
    """A version as an evaluation scored it: what delivery chooses among."""

    version: int
    step: int  # the run's clock when it was current
    mean_return: float
    filmed: bool = False  # its evaluation filmed an episode


@dataclass(frozen=True)
class Scored:
    """An evaluation, and the run's clock when its version was current: the env steps it had
    collected (an offline run: the gradient steps it had taken)."""

    step: int
    result: EvaluationResult

    @property
    def version(self) -> int:
        return self.result.version

    @property
    def mean_return(self) -> float:
        return self.result.mean_return

    def standing(self) -> Standing:
        return Standing(self.version, self.step, self.mean_return, self.result.film is not None)

    def metrics(self) -> dict[str, float]:
        returns = np.asarray(self.result.returns)
        return {
            "eval/return_mean": float(returns.mean()),
            "eval/return_std": float(returns.std()),
            "eval/return_min": float(returns.min()),
            "eval/return_max": float(returns.max()),
            "eval/episode_length_mean": float(np.mean(self.result.lengths)),
            "eval/policy_version": float(self.result.version),
        } | {f"eval/{group}/return_mean": float(group_returns.mean())
             for group, group_returns in self.result.group_returns().items()}


class EvaluationSchedule:
    """Evaluations during training; see the module's docstring. Close it when training ends."""

    def __init__(self, hosts: Hosts, plan: RoundPlan, budget: Budget, blocking: bool, logger: AnyLogger):
        self.hosts, self.plan, self.budget, self.blocking, self.logger = hosts, plan, budget, blocking, logger
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="evaluation")
        self._running: tuple[Future[EvaluationResult], int, int] | None = None  # with its clock and version

    def start_if_due(self, state: LoopState) -> int:
        """Start scoring `state.version` if an evaluation is due and none is running; returns
        the clock at which the next one is due."""
        if self._running is not None or self.budget.spent(state) < state.next_evaluation:
            return state.next_evaluation
        in_flow_run = contextvars.copy_context()  # the evaluation's task run belongs to this flow run
        future = self._thread.submit(in_flow_run.run, evaluate, self.hosts, self.plan, state.version)
        self._running = (future, self.budget.spent(state), state.version)
        return state.next_evaluation + self.budget.evaluate_every

    def scoring(self) -> frozenset[int]:
        """The version an evaluation is scoring, until its result has been taken."""
        return frozenset() if self._running is None else frozenset({self._running[2]})

    def finished(self) -> Scored | None:
        """The evaluation that finished: waited for if the schedule is blocking."""
        if self._running is None or not (self.blocking or self._running[0].done()):
            return None
        return self.wait()

    def wait(self) -> Scored | None:
        """The evaluation still running, once it has finished; None if none runs."""
        if self._running is None:
            return None
        future, step, _ = self._running
        self._running = None
        return Scored(step, self.result_of(future))

    def score_now(self, state: LoopState) -> Scored:
        """An evaluation of `state.version`, waited for."""
        in_flow_run = contextvars.copy_context()
        future = self._thread.submit(in_flow_run.run, evaluate, self.hosts, self.plan, state.version)
        return Scored(self.budget.spent(state), self.result_of(future))

    def result_of(self, future: Future[EvaluationResult]) -> EvaluationResult:
        """The result of an evaluation or film of this schedule's thread, once it has one. While
        the caller waits, it runs their jobs that still wait for a starting host (single mode's
        helper) itself: it would only wait, where the thread would share the GIL with the learner."""
        hosts = self.hosts.for_evaluations()
        while not future.done():
            if not hosts.run_one_queued_here():
                concurrent.futures.wait([future], timeout=QUEUED_JOBS_POLL_S)
        return future.result()

    @property
    def films_final(self) -> bool:
        return self.plan.preset.tracking.video == "final"

    def film(self, version: int) -> Future[EvaluationResult]:
        """A film of `version` (`film_version`), made on the evaluation thread."""
        return self._thread.submit(film_version, self.hosts, self.plan, version, self.logger)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


def film_version(hosts: Hosts, plan: RoundPlan, version: int, logger: AnyLogger) -> EvaluationResult:
    """A film of `version` alone: its first evaluation episode, played and filmed by one worker."""
    return evaluate_version(hosts, [replace(plan.evaluations(version, final=True)[0], episodes=1)], logger)


@task(name="evaluate", task_run_name="evaluate-v{version}", cache_policy=NO_CACHE)
def evaluate(hosts: Hosts, plan: RoundPlan, version: int) -> EvaluationResult | State:
    """Greedy episodes of `version` on the rollout workers, as a task run of the flow run."""
    try:
        return evaluate_version(hosts, plan.evaluations(version), get_run_logger())
    except (Exception, KeyboardInterrupt):  # an interrupt in this thread: the stop (gymflow/stops.py)
        if hosts.closed or stopped():  # the run is stopping (Ctrl-C): its cluster went away under this evaluation
            return Cancelled(message=f"the run stopped while v{version} was being evaluated")
        raise
