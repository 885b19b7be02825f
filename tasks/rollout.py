"""The Prefect tasks that fan rollouts and evaluations out over Dask.

A Prefect task wraps one whole round (every worker's job), so Prefect's per-task overhead is
paid once per round, not once per worker; inside it, plain Dask futures carry the jobs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from distributed import Client, Future
from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.jobs import EvaluationResult, EvaluationSpec, RolloutSpec, run_evaluation, run_rollout
from tasks.shards import ShardRef


@task(name="collect-rollouts", task_run_name="collect-rollouts-{label}", cache_policy=NO_CACHE)
def collect_rollouts(client: Client, specs: Sequence[RolloutSpec], timeout_s: float, label: str) -> list[ShardRef]:
    """One round of collection: every worker's rollout, each writing one shard."""
    return _run_round(client, run_rollout, specs, timeout_s)


@task(name="evaluate", task_run_name="evaluate-v{version}", cache_policy=NO_CACHE)
def evaluate_policy(
    client: Client, specs: Sequence[EvaluationSpec], timeout_s: float, version: int
) -> EvaluationResult:
    """Greedy evaluation of one version, its episodes split across the workers."""
    results = _run_round(client, run_evaluation, specs, timeout_s)
    return EvaluationResult(
        version=version,
        returns=tuple(r for result in results for r in result.returns),
        lengths=tuple(n for result in results for n in result.lengths),
        seconds=max(result.seconds for result in results),
    )


def _run_round(client: Client, function: Callable, specs: Sequence[Any], timeout_s: float) -> list[Any]:
    """Submit one job per spec, job i preferring worker i (so live envs are found again), and
    wait for all of them; the whole round shares one deadline."""
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    if not workers:  # all workers are being replaced: wait for one rather than fail the round
        client.wait_for_workers(1, timeout=timeout_s)
        workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    futures: list[Future] = [
        client.submit(function, spec, workers=[workers[i % len(workers)]], allow_other_workers=True, pure=False)
        for i, spec in enumerate(specs)
    ]
    deadline = time.monotonic() + timeout_s
    try:
        return [future.result(timeout=max(deadline - time.monotonic(), 0.0)) for future in futures]
    except TimeoutError:
        unfinished = [future for future in futures if not future.done()]
        client.cancel(futures)
        raise TimeoutError(f"{len(unfinished)} of {len(futures)} jobs did not finish within {timeout_s:.0f} s") from None
