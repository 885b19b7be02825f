"""Population-based training as the sweep flow runs it (`sampler: pbt`): every member an improve
run of its own (`SWEEP_ID-mNNN`), trained interval by interval on the sweep's shared Dask
cluster; at each interval's end every member pauses (checkpointed and scored), the sweep decides
who copies whom with which values (tasks/sweep/pbt.py), and each member's run goes on in place.

Killed at any point and started again with the same sweep id, it redoes nothing: decisions and
results are read back from the study, a member interrupted mid-interval resumes from its last
checkpoint, and a copy is made only while the copier still stands where it paused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import optuna
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture

from gymflow.flows.improve import improve
from gymflow.flows.waiting import first_finished
from gymflow.presets.sweep import Sweep
from gymflow.stops import a_run
from gymflow.tasks.storage.objects import Storage, open_storage, storage_location
from gymflow.tasks.storage.records import has_run_record
from gymflow.tasks.sweep.lineage import settings_in_words
from gymflow.tasks.sweep.pbt import (
    MemberResult,
    first_plan,
    member_run_id,
    next_plan,
    pause_points,
    pin_sources,
    record_plan,
    record_result,
    recorded_plan,
    recorded_results,
    unpin_sources,
)
from gymflow.tasks.sweep.trial import PbtMember


@dataclass(frozen=True)
class Population:
    """A population-based sweep as it ended: each interval's plan and results (the lineage)."""

    plans: list[list[PbtMember]]
    results: list[dict[int, MemberResult]]
    trained: int  # member intervals this start trained (a restart counts only its own)

    def final(self) -> list[MemberResult]:
        """Each member's last result: where it finished (or, having failed, last paused)."""
        last: dict[int, MemberResult] = {}
        for results in self.results:
            last.update(results)
        return [last[member] for member in sorted(last)]


def train_population(sweep: Sweep, sweep_id: str, study: optuna.Study, parent_run_id: str,
                     on_result: Callable[[MemberResult], None]) -> Population:
    """Every interval's members, at most `concurrency` at once; between intervals, the copies."""
    storage = open_storage(storage_location(sweep.base.storage))
    plan = recorded_plan(study, 0) or record_plan(study, 0, first_plan(sweep, sweep_id, parent_run_id))
    plans, results, trained = [plan], [], 0
    for interval, pause_at in enumerate(pause_points(sweep)):
        done = recorded_results(study, interval)
        for result in _train_interval(sweep, [m for m in plan if m.member not in done], sweep.spec.concurrency):
            record_result(study, result)
            done[result.member], trained = result, trained + 1
            on_result(result)
        results.append(done)
        if interval > 0:
            unpin_sources(storage, plan)
        if pause_at is None or not done:
            break
        plan = recorded_plan(study, interval + 1) or record_plan(study, interval + 1,
                                                                 next_plan(sweep, plan, list(done.values())))
        if not plan:
            break
        _announce_copies(plan)
        pin_sources(storage, plan)
        plans.append(plan)
    return Population(plans, results, trained)


def _announce_copies(plan: list[PbtMember]) -> None:
    logger = get_run_logger()
    for member in plan:
        if (copy := member.copy_from) is not None:
            logger.info("interval %d: member %d copies member %d (v%d), then trains with %s", member.interval,
                        member.member, copy.source, copy.version, settings_in_words(member.settings))


def _train_interval(sweep: Sweep, members: list[PbtMember], concurrency: int) -> Iterator[MemberResult]:
    """The members' interval runs, at most `concurrency` at once; a member whose run failed is
    left out of what follows (said as a warning)."""
    pending, running = list(members), {}
    while pending or running:
        while pending and len(running) < concurrency:
            member = pending.pop(0)
            running[train_member.submit(sweep, member)] = member
        future: PrefectFuture = first_finished(list(running))
        member = running.pop(future)
        try:
            yield future.result()
        except Exception as error:  # noqa: BLE001 (a failed member drops out, the population goes on)
            get_run_logger().warning("member %d failed in interval %d and drops out: %s", member.member,
                                     member.interval, str(error).splitlines()[0] if str(error) else repr(error))


@task(name="train-member", task_run_name="train-m{member.member}-interval{member.interval}", cache_policy=NO_CACHE)
def train_member(sweep: Sweep, member: PbtMember) -> MemberResult:
    """One member's interval: its run started (interval 0), continued, or resumed where a killed
    sweep left it; paused at the interval's end, or ended at the budget's."""
    run_id = member_run_id(member.sweep_id, member.member)
    storage: Storage = open_storage(storage_location(sweep.base.storage))
    going_on = has_run_record(storage, run_id)
    overrides = {**sweep.spec.overrides, **member.settings, "seed": sweep.base.seed + member.member}
    named = improve.with_options(flow_run_name=f"{run_id} interval {member.interval}")
    with a_run():  # counted before its flow run is made (seconds on a busy SQLite): a stop meanwhile ends it
        summary = named(sweep.spec.preset, overrides, resume=run_id if going_on else None,
                        run_id=None if going_on else run_id, sweep_trial=member)
    return MemberResult.of(member, summary, sweep.spec.pbt.window, storage)
