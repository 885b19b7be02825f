"""Rounds of rollouts and evaluations fanned out over Dask: one job per worker, each a call on
that worker's job host (tasks/hosts.py).

They run inside the `train` task's stretches (tasks/learn.py); heatup's collection and a run's
final evaluation are Prefect tasks of their own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks.hosts import HostPool, wait_first
from tasks.jobs import EvaluationResult, EvaluationSpec, RolloutSpec, run_evaluation, run_rollout
from tasks.shards import ShardRef


def collect_rollouts(hosts: HostPool, specs: Sequence[RolloutSpec], logger) -> list[ShardRef]:
    """One round of collection: every worker's rollout, each writing one shard."""
    return run_round(hosts, run_rollout, specs, logger)


def evaluate_version(hosts: HostPool, specs: Sequence[EvaluationSpec], version: int, logger) -> EvaluationResult:
    """Greedy evaluation of one version, its episodes split across the workers."""
    results = run_round(hosts, run_evaluation, specs, logger)
    return EvaluationResult(
        version=version,
        returns=tuple(r for result in results for r in result.returns),
        lengths=tuple(n for result in results for n in result.lengths),
        seconds=max(result.seconds for result in results),
    )


@task(name="collect-rollouts", task_run_name="collect-rollouts-heatup", cache_policy=NO_CACHE)
def collect_heatup(hosts: HostPool, specs: Sequence[RolloutSpec]) -> list[ShardRef]:
    """Heatup's round: every worker's rollout with a uniform random policy."""
    return collect_rollouts(hosts, specs, get_run_logger())


@task(name="evaluate", task_run_name="evaluate-v{version}", cache_policy=NO_CACHE)
def evaluate_policy(hosts: HostPool, specs: Sequence[EvaluationSpec], version: int) -> EvaluationResult:
    """A run's final evaluation, of the version it delivers."""
    return evaluate_version(hosts, specs, version, get_run_logger())


def run_round(hosts: HostPool, function: Callable, specs: Sequence[Any], logger) -> list[Any]:
    """Run one job per spec and return their results in spec order.

    Job i goes to worker i among those offering the rollout resources (so its live envs are
    found again). A job whose worker dies is sent to a live worker; a job still running at its
    deadline is treated as wedged: its worker process is restarted and the job sent again. Each
    job has `tasks.hosts.ATTEMPTS` tries; waiting forever is not an outcome."""
    calls = {index: hosts.call(function, spec, slot=index) for index, spec in enumerate(specs)}
    results: dict[int, Any] = {}
    while calls:
        wait_first(calls.values(), min(call.deadline for call in calls.values()) - time.monotonic())
        for index, call in list(calls.items()):
            call = calls[index] = hosts.settle(call, logger)
            if call.finished:
                results[index] = call.future.result()  # a job that failed raises here
                del calls[index]
    return [results[index] for index in range(len(specs))]
