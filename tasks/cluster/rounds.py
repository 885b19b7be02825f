"""Rounds of jobs on the workers' job hosts (tasks/cluster/hosts.py), and the plan that derives
every job's spec, seeds included, from the preset and the run id.

A SYNC round is one rollout job per worker; an evaluation is its episodes split across the
workers; an ASYNC chunk is one worker's next rollout; before all of them, each worker checks it
can make the env. The plan is pure; `run_round` is the I/O.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Literal

import numpy as np

from gymflow.envs.seeding import derive_seed
from gymflow.errors import ClusterUnavailable
from gymflow.logs import AnyLogger
from gymflow.presets.model import Preset
from gymflow.presets.validate import Experiment, rollout_backend
from gymflow.stops import end_if_stopped
from gymflow.tasks.cluster.hosts import Call, Hosts, wait_first
from gymflow.tasks.cluster.jobs import check_worker, run_evaluation, run_rollout, run_rollouts
from gymflow.tasks.cluster.messages import (
    EvaluationResult,
    EvaluationSpec,
    HeldOutSource,
    InferenceAddress,
    RolloutSpec,
    WorkerCheckSpec,
)
from gymflow.tasks.cluster.wire import describe_job
from gymflow.tasks.lake.decision_log import decision_log_location
from gymflow.tasks.storage.objects import storage_location
from gymflow.tasks.storage.shards import ShardRef


@dataclass(frozen=True)
class RoundPlan:
    """The specs of one run's jobs."""

    preset: Preset
    run_id: str
    inference: InferenceAddress | None = None  # where workers that reach it get their network's outputs

    @property
    def workers(self) -> int:
        return self.preset.distribution.rollout_workers

    @cached_property
    def backend(self) -> str:
        """What steps the rollout workers' envs (env.backend, `auto` resolved)."""
        return rollout_backend(self.preset)

    @property
    def heatup_steps_per_env(self) -> int:
        return math.ceil(self.preset.schedule.heatup_env_steps / self.preset.envs_in_total)

    def rollouts(self, version: int | None, exploration: float, cursors: Sequence[str | None]) -> list[RolloutSpec]:
        """One spec per rollout worker, continuing each worker's envs from `cursors`;
        `version=None` is heatup's uniform random policy."""
        steps = self.heatup_steps_per_env if version is None else self.preset.schedule.rollout_steps_per_env
        round_name = "heatup" if version is None else version
        return [
            replace(self._rollout(worker, version, exploration, cursors[worker], steps,
                                  policy_seed=derive_seed(self.preset.seed, "policy", round_name, worker)),
                    opponent_version=self.opponent(version, worker))
            for worker in range(self.workers)
        ]

    def opponent(self, version: int | None, worker: int) -> int | None:
        """The past version worker `worker`'s games face in round `version` (schedule.opponent_pool),
        drawn from the seed; None: the acting version plays both sides."""
        pool = self.preset.schedule.opponent_pool
        members = pool.members(version) if pool is not None and version is not None else []
        if not members:
            return None
        draw = np.random.default_rng(derive_seed(self.preset.seed, "opponent", version, worker))
        faces_past = draw.random() < pool.share
        member = members[int(draw.integers(len(members)))]
        return member if faces_past else None

    def chunk(self, worker: int, chunk: int, exploration: float, cursor: str | None) -> RolloutSpec:
        """ASYNC: worker `worker`'s `chunk`-th rollout, acting with the newest committed version."""
        seed = derive_seed(self.preset.seed, "policy", "async", worker, chunk)
        spec = self._rollout(worker, "newest", exploration, cursor, self.preset.schedule.rollout_steps_per_env, seed)
        return replace(spec, chunk=chunk)

    def evaluations(self, version: int, final: bool = False) -> list[EvaluationSpec]:
        """The evaluation episodes split across workers; the same seeds at every evaluation. The
        first worker films its first episode where the preset's `tracking.video` asks for it."""
        preset, video = self.preset, self.preset.tracking.video
        films = video == "every_evaluation" or (final and video == "final")
        shares = np.array_split(np.arange(preset.schedule.evaluation_episodes), self.workers)
        specs = [
            EvaluationSpec(
                storage=storage_location(preset.storage), run_id=self.run_id, env_id=preset.env.id,
                env_kwargs=dict(preset.env.kwargs), preprocessing=preset.env.preprocessing().evaluation(),
                agent=preset.agent, policy_version=version, episodes=len(share),
                seed=derive_seed(preset.seed, "evaluation", part), film=films and part == 0,
                opponent=preset.schedule.evaluation_opponent,
            )
            for part, share in enumerate(shares)
            if len(share)
        ]
        return specs if preset.schedule.evaluate_on == "env" else self._on_held_out_decisions(specs)

    def _on_held_out_decisions(self, specs: list[EvaluationSpec]) -> list[EvaluationSpec]:
        """schedule.evaluate_on decisions: each worker scores a part of the held-out decisions, none films."""
        dataset = self.preset.dataset
        assert dataset is not None and dataset.decisions is not None  # presets/validate.py checked it
        location = decision_log_location(dataset.decisions, dataset.options, self.preset.storage)
        return [replace(spec, film=False, held_out=HeldOutSource(location, dataset.holdout, dataset.logged_before,
                                                                 part, len(specs)))
                for part, spec in enumerate(specs)]

    def _rollout(self, worker: int, version: int | Literal["newest"] | None, exploration: float,
                 cursor: str | None, steps: int, policy_seed: int) -> RolloutSpec:
        preset = self.preset
        return RolloutSpec(
            storage=storage_location(preset.storage), run_id=self.run_id, env_id=preset.env.id,
            env_kwargs=dict(preset.env.kwargs), preprocessing=preset.env.preprocessing(), agent=preset.agent,
            policy_version=version, worker=worker,
            num_envs=preset.distribution.envs_per_worker, steps_per_env=steps,
            env_seed=derive_seed(preset.seed, "envs", worker), policy_seed=policy_seed,
            exploration=exploration, resume_from=cursor, inference=self.inference, backend=self.backend,
            env_threads=preset.distribution.env_threads,
        )


def check_workers(hosts: Hosts, experiment: Experiment, logger: AnyLogger) -> None:
    """The pre-flight: each worker the run's jobs go to makes the env once and compares its spaces
    with the flow's. A worker that cannot (a module, a package, an extra it lacks) stops the run
    here, in one line naming it, before heatup and before anything is written."""
    preset, algorithm = experiment.preset, experiment.algorithm
    spec = WorkerCheckSpec(preset.env.id, dict(preset.env.kwargs), preset.env.preprocessing(), algorithm.name,
                           algorithm.action_spaces, algorithm.reads_images, experiment.observation_space,
                           experiment.action_space, storage_location(preset.storage), rollout_backend(preset))
    checks = run_round(hosts, check_worker, [spec] * hosts.distinct_slots(preset.distribution.rollout_workers),
                       logger)
    for check in checks:
        if check.problem:
            hint = (" (distribution.ship_env_module sends a working-folder module to the workers)"
                    if "cannot import" in check.problem and ":" in preset.env.id else "")
            raise ClusterUnavailable(check.field, f"the Dask worker {check.worker} cannot run this preset's jobs: "
                                                  f"{check.problem}{hint}")


def collect_round(hosts: Hosts, specs: Sequence[RolloutSpec], logger: AnyLogger) -> list[ShardRef]:
    """One round of collection: every worker's rollout, each writing one shard; in one process
    (single mode), one job that steps every worker's envs together."""
    if hosts.one_process:
        [shards] = run_round(hosts, run_rollouts, [specs], logger)
        return shards
    return run_round(hosts, run_rollout, specs, logger, name_stalls=True)


def evaluate_version(hosts: Hosts, specs: Sequence[EvaluationSpec], logger: AnyLogger) -> EvaluationResult:
    """Greedy evaluation of one version, its episodes split across the workers."""
    results = run_round(hosts, run_evaluation, specs, logger)
    return EvaluationResult(
        version=specs[0].policy_version,
        returns=tuple(r for result in results for r in result.returns),
        lengths=tuple(n for result in results for n in result.lengths),
        seconds=max(result.seconds for result in results),
        film=results[0].film,
        no_film=results[0].no_film,
        groups=tuple(group for result in results for group in result.groups),
    )


def run_round(hosts: Hosts, function: Callable, specs: Sequence[Any], logger: AnyLogger,
              name_stalls: bool = False) -> list[Any]:
    """Run one job per spec and return their results in spec order.

    Job i goes to worker i among those offering the rollout resources (so its live envs are
    found again). A job whose worker dies is sent to a live worker; a job still running at its
    deadline is treated as wedged: its worker process is restarted and the job sent again. Each
    job has `hosts.ATTEMPTS` tries; waiting forever is not an outcome. With `name_stalls` (rollouts,
    which take as many steps each: evaluations' episodes differ in length), a job still running
    `STALL_NOTICE_S` after the round's first one finished (a slow or cut-off worker) is named once."""
    calls = {index: hosts.call(function, spec, slot=index) for index, spec in enumerate(specs)}
    results: dict[int, Any] = {}
    stalls = StallNotice(logger)
    while calls:
        wait_s = min(call.deadline for call in calls.values()) - time.monotonic()
        wait_first(calls.values(), min(wait_s, STALL_NOTICE_S, STOP_CHECK_S))
        end_if_stopped()  # a sweep's run, in a thread of its own: not a job sent again to a cluster closing
        for index, call in list(calls.items()):
            call = calls[index] = hosts.settle(call, logger)
            if call.finished:
                results[index] = call.future.result()  # a job that failed raises here
                del calls[index]
        stalls.name(calls.values(), finished=name_stalls and bool(results))
    return [results[index] for index in range(len(specs))]


STALL_NOTICE_S = 10.0
STOP_CHECK_S = 0.5  # a round's wait, in slices: a stopped sweep's runs end within seconds, long rounds or not


class StallNotice:
    """Names, once each, the jobs of a round still running `STALL_NOTICE_S` after its first job
    finished: a partition or a slow worker otherwise shows only as a round that takes longer."""

    def __init__(self, logger: AnyLogger):
        self.logger = logger
        self.first_finished: float | None = None
        self.named: set[int] = set()

    def name(self, running: Iterable[Call], finished: bool) -> None:
        if not finished:
            return
        now = time.monotonic()
        self.first_finished = self.first_finished or now
        if now - self.first_finished < STALL_NOTICE_S:
            return
        for call in running:
            if id(call.future) not in self.named:
                self.named.add(id(call.future))
                self.logger.warning(
                    "%s on the Dask worker %s is still running %.0f s after the round's first job finished; "
                    "waiting for it (a slow or cut-off worker; it is sent again after distribution.rollout_timeout_s)",
                    describe_job(call.function, call.spec, call.slot), call.worker or "?", now - self.first_finished)
