"""The Prefect tasks that fan rollouts and evaluations out over Dask.

A Prefect task wraps one whole round (every worker's job), so Prefect's per-task overhead is
paid once per round, not once per worker; inside it, the jobs go to the workers' job hosts
(tasks/hosts.py), a Dask actor call each.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks.hosts import HostLost, HostPool, wait_first
from tasks.jobs import EvaluationResult, EvaluationSpec, RolloutSpec, run_evaluation, run_rollout
from tasks.shards import ShardRef


@task(name="collect-rollouts", task_run_name="collect-rollouts-{label}", cache_policy=NO_CACHE)
def collect_rollouts(hosts: HostPool, specs: Sequence[RolloutSpec], label: str) -> list[ShardRef]:
    """One round of collection: every worker's rollout, each writing one shard."""
    return run_round(hosts, run_rollout, specs, get_run_logger())


@task(name="evaluate", task_run_name="evaluate-v{version}", cache_policy=NO_CACHE)
def evaluate_policy(hosts: HostPool, specs: Sequence[EvaluationSpec], version: int) -> EvaluationResult:
    """Greedy evaluation of one version, its episodes split across the workers."""
    results = run_round(hosts, run_evaluation, specs, get_run_logger())
    return EvaluationResult(
        version=version,
        returns=tuple(r for result in results for r in result.returns),
        lengths=tuple(n for result in results for n in result.lengths),
        seconds=max(result.seconds for result in results),
    )


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
            if call.done():
                try:
                    results[index] = call.future.result()  # a job that failed raises here
                    del calls[index]
                except HostLost as lost:
                    hosts.lost(call)
                    calls[index] = hosts.redo(call, str(lost), logger)
            elif time.monotonic() > call.deadline:
                hosts.restart(call)
                calls[index] = hosts.redo(call, f"job {index} was still running after {hosts.timeout_s:.0f} s; "
                                                f"restarted its worker {call.worker}", logger)
    return [results[index] for index in range(len(specs))]
