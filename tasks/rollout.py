"""The Prefect tasks that fan rollouts and evaluations out over Dask.

A Prefect task wraps one whole round (every worker's job), so Prefect's per-task overhead is
paid once per round, not once per worker; inside it, plain Dask futures carry the jobs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from distributed import Client, Future
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks.jobs import EvaluationResult, EvaluationSpec, RolloutSpec, run_evaluation, run_rollout
from tasks.shards import ShardRef

ROUND_ATTEMPTS = 3


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
    client: Client, function: Callable, specs: Sequence[Any], timeout_s: float, resources: dict[str, float] | None,
    attempts: int = ROUND_ATTEMPTS,
) -> list[Any]:
    """Run one job per spec and return their results in spec order.

    Job i prefers worker i among those offering `resources` (so its live envs are found again).
    A worker that dies mid-job is replaced by Dask and the job rescheduled. A job still running
    at the round's deadline is treated as wedged: its worker process is restarted and the job
    submitted again, up to `attempts` times. Waiting forever is not an outcome."""
    results: dict[int, Any] = {}
    pending = dict(enumerate(specs))
    for attempt in range(1, attempts + 1):
        futures = _submit(client, function, pending, resources, timeout_s)
        deadline = time.monotonic() + timeout_s
        try:
            for index, future in futures.items():
                results[index] = future.result(timeout=max(deadline - time.monotonic(), 0.0))
            return [results[index] for index in range(len(specs))]
        except TimeoutError:
            wedged = {index: future for index, future in futures.items() if not future.done()}
            results |= {index: future.result() for index, future in futures.items() if index not in wedged}
            workers = [w for w, keys in client.processing().items() if {f.key for f in wedged.values()} & set(keys)]
            client.cancel(list(wedged.values()))
            if workers:
                client.restart_workers(workers, raise_for_error=False)
            get_run_logger().warning(
                "%d of %d jobs still running after %.0f s (attempt %d of %d); restarted %s and submitting them again",
                len(wedged), len(futures), timeout_s, attempt, attempts, workers or "no worker",
            )
            pending = {index: specs[index] for index in wedged}
    raise TimeoutError(f"{len(pending)} of {len(specs)} jobs did not finish within {timeout_s:.0f} s, {attempts} times")


def _submit(
    client: Client, function: Callable, specs: dict[int, Any], resources: dict[str, float] | None, wait_s: float
) -> dict[int, Future]:
    workers = able_workers(client, resources)
    if not workers:  # none yet, or all being replaced: wait for one rather than fail the round
        client.wait_for_workers(1, timeout=wait_s)
        workers = able_workers(client, resources)
    return {
        index: client.submit(
            function, spec, workers=[workers[index % len(workers)]] if workers else None,
            allow_other_workers=True, resources=resources or None, pure=False,
        )
        for index, spec in specs.items()
    }


def able_workers(client: Client, resources: dict[str, float] | None) -> list[str]:
    workers = client.scheduler_info(n_workers=-1)["workers"]
    return sorted(
        address for address, info in workers.items()
        if all(info.get("resources", {}).get(name, 0) >= amount for name, amount in (resources or {}).items())
    )
