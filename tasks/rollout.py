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
def collect_rollouts(
    client: Client, specs: Sequence[RolloutSpec], timeout_s: float, label: str, resources: dict[str, float] | None = None
) -> list[ShardRef]:
    """One round of collection: every worker's rollout, each writing one shard."""
    return _run_round(client, run_rollout, specs, timeout_s, resources)


@task(name="evaluate", task_run_name="evaluate-v{version}", cache_policy=NO_CACHE)
def evaluate_policy(
    client: Client, specs: Sequence[EvaluationSpec], timeout_s: float, version: int, resources: dict[str, float] | None = None
) -> EvaluationResult:
    """Greedy evaluation of one version, its episodes split across the workers."""
    results = _run_round(client, run_evaluation, specs, timeout_s, resources)
    return EvaluationResult(
        version=version,
        returns=tuple(r for result in results for r in result.returns),
        lengths=tuple(n for result in results for n in result.lengths),
        seconds=max(result.seconds for result in results),
    )


def _run_round(
    client: Client, function: Callable, specs: Sequence[Any], timeout_s: float, resources: dict[str, float] | None
) -> list[Any]:
    """Submit one job per spec, job i preferring worker i among those with the resources asked
    for (so live envs are found again), and wait for all of them within one deadline."""
    workers = _able_workers(client, resources)
    if not workers:  # none yet, or all being replaced: wait for one rather than fail the round
        client.wait_for_workers(1, timeout=timeout_s)
        workers = _able_workers(client, resources)
    futures: list[Future] = [
        client.submit(
            function, spec, workers=[workers[i % len(workers)]] if workers else None,
            allow_other_workers=True, resources=resources or None, pure=False,
        )
        for i, spec in enumerate(specs)
    ]
    deadline = time.monotonic() + timeout_s
    try:
        return [future.result(timeout=max(deadline - time.monotonic(), 0.0)) for future in futures]
    except TimeoutError:
        unfinished = [future for future in futures if not future.done()]
        client.cancel(futures)
        raise TimeoutError(f"{len(unfinished)} of {len(futures)} jobs did not finish within {timeout_s:.0f} s") from None


def _able_workers(client: Client, resources: dict[str, float] | None) -> list[str]:
    workers = client.scheduler_info(n_workers=-1)["workers"]
    return sorted(
        address for address, info in workers.items()
        if all(info.get("resources", {}).get(name, 0) >= amount for name, amount in (resources or {}).items())
    )
