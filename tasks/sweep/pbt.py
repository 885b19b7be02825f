"""Population-based training's decisions (Jaderberg et al. 2017), apart from the flow that runs
them: a population's first values, where its members pause, and at each pause which members copy
which (exploit) and the values the copies go on with (explore).

Every decision is a function of the spec and of what the members scored, with a random generator
seeded from `sampler_seed` and the interval's number, so a sweep killed at any moment and started
again decides the same. Decisions and results are also recorded in the sweep's Optuna storage as
they are made (`record_plan`, `record_result`): a restart reads them rather than asking again.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import optuna

from gymflow.envs.seeding import derive_seed
from gymflow.errors import InvalidPreset
from gymflow.presets.sweep import Choice, Range, Sweep
from gymflow.presets.validate import resolve_experiment
from gymflow.tasks.storage.checkpoints import MANIFEST, latest_version
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage
from gymflow.tasks.sweep.trial import PbtCopy, PbtMember
from gymflow.tasks.training.summary import RunSummary

PLAN_ATTR = "pbt:plan:"  # + interval: the members' PbtMember records, as JSON
RESULT_ATTR = "pbt:result:"  # + interval:member: a MemberResult, as JSON


@dataclass(frozen=True)
class MemberResult:
    """How a member's interval ended: paused (to be continued) or finished (its budget spent, or
    its target reached), with its score and where it stood."""

    member: int
    interval: int
    run_id: str
    mlflow_run_id: str
    score: float  # the mean of its newest `window` evaluation returns
    version: int  # the version it paused or ended at (its checkpoint)
    clock: int  # env steps (offline: gradient steps)
    finished: bool
    final_return: float  # the evaluation of `version`
    curve: tuple[tuple[int, float], ...]  # (clock, mean evaluation return) of every evaluation so far
    model_uri: str = ""  # the delivered policy, once finished

    @classmethod
    def of(cls, member: PbtMember, summary: RunSummary, window: int, storage: Storage) -> MemberResult:
        curve = tuple((row.env_steps, row.mean) for row in summary.evaluations)
        newest = [value for _, value in curve[-window:]] or [float(summary.final_return)]
        version = summary.delivered_version if summary.paused else \
            copyable_version(storage, summary.run_id, summary.delivered_version)
        return cls(member.member, member.interval, summary.run_id, summary.mlflow_run_id, float(np.mean(newest)),
                   version, summary.clock, not summary.paused, float(summary.final_return), curve, summary.model_uri)

    @classmethod
    def from_json(cls, text: str) -> MemberResult:
        data = json.loads(text)
        return cls(**{**data, "curve": tuple((int(clock), float(value)) for clock, value in data["curve"])})


def copyable_version(storage: Storage, run_id: str, delivered: int) -> int:
    """The version a copier takes of a member that ended (at its target or its budget): the
    delivered one where the checkpoint cadence kept it, else the run's newest checkpoint, its end (a
    paused member's delivered version is the checkpoint of its pause)."""
    layout = RunLayout(run_id)
    if storage.exists(f"{layout.checkpoint(delivered)}/{MANIFEST}"):
        return delivered
    return latest_version(storage, layout)


def member_run_id(sweep_id: str, member: int) -> str:
    return f"{sweep_id}-m{member:03d}"


def pause_points(sweep: Sweep) -> list[int | None]:
    """Where each interval ends on the run's clock: every `pbt.interval`, then the budget (None:
    the run ends there, delivered)."""
    total = sweep.base.schedule.total_train_steps if sweep.base.offline else sweep.base.schedule.total_env_steps
    every = sweep.spec.pbt.interval
    return [*range(every, total, every), None]


def first_plan(sweep: Sweep, sweep_id: str, parent_run_id: str | None = None) -> list[PbtMember]:
    """Interval 0: each member's values drawn from the space (seeded by the member's number)."""
    pauses, seed = pause_points(sweep), sweep.spec.sampler_seed
    return [PbtMember(sweep_id=sweep_id, member=member, interval=0, pause_at=pauses[0],
                      settings=_drawn(sweep, np.random.default_rng(derive_seed(seed, "pbt", member))),
                      mlflow_parent_run_id=parent_run_id)
            for member in range(sweep.spec.pbt.population)]


def next_plan(sweep: Sweep, plan: Sequence[PbtMember], results: Sequence[MemberResult]) -> list[PbtMember]:
    """The next interval's: the members still training, ranked by score; the lowest `quantile`
    copy one of the highest `quantile` (drawn) and go on with its values perturbed; the others go
    on as they are. A member that finished (its target reached) may be copied but trains no more;
    one that failed drops out."""
    interval = plan[0].interval + 1
    pause_at = pause_points(sweep)[interval]
    rng = np.random.default_rng(derive_seed(sweep.spec.sampler_seed, "pbt-exploit", interval))
    ranked = sorted(results, key=lambda r: (-r.score if math.isfinite(r.score) else math.inf, r.member))
    count = min(math.ceil(len(ranked) * sweep.spec.pbt.quantile), len(ranked) // 2)  # never both best and worst
    best, worst = ranked[:count], {result.member for result in ranked[len(ranked) - count:]}
    by_member = {member.member: member for member in plan}
    going_on = []
    for result in sorted(results, key=lambda r: r.member):
        if result.finished:
            continue
        member = by_member[result.member].model_copy(update={"interval": interval, "pause_at": pause_at,
                                                             "copy_from": None})
        if result.member in worst and best:
            source = best[int(rng.integers(len(best)))]
            member = member.model_copy(update={
                "settings": explored(sweep, by_member[source.member].settings, rng),
                "copy_from": PbtCopy(source=source.member, source_run_id=source.run_id, version=source.version,
                                     at_version=result.version, settings_before=member.settings)})
        going_on.append(member)
    return going_on


def explored(sweep: Sweep, settings: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """A copy's values: each drawn anew with `resample_probability`, else a number multiplied by
    one of `factors` (clamped to its range) and a listed value moved to a neighbour."""
    pbt = sweep.spec.pbt
    changed = {}
    for key, param in sweep.spec.space.items():
        if rng.random() < pbt.resample_probability:
            changed[key] = _draw(param, rng)
        elif isinstance(param, Range):
            value = min(max(settings[key] * pbt.factors[int(rng.integers(2))], param.low), param.high)
            changed[key] = int(round(value)) if param.integer else float(value)
        else:
            index = param.values.index(settings[key]) + (1 if rng.integers(2) else -1)
            changed[key] = param.values[min(max(index, 0), len(param.values) - 1)]
    return changed


def _drawn(sweep: Sweep, rng: np.random.Generator) -> dict[str, Any]:
    return {key: _draw(param, rng) for key, param in sweep.spec.space.items()}


def _draw(param: Choice | Range, rng: np.random.Generator) -> Any:
    if isinstance(param, Choice):
        return param.values[int(rng.integers(len(param.values)))]
    if param.log:
        value = float(math.exp(rng.uniform(math.log(param.low), math.log(param.high))))
    else:
        value = float(rng.uniform(param.low, param.high))
    return int(round(value)) if param.integer else value


def check_perturbable(sweep: Sweep) -> None:
    """Each searched field at each end of its range (each listed value) must leave the learner's
    tensors as they are: a copy loads one member's learner into another's. Builds the learners."""
    from gymflow.tasks.training.learning import create_learner  # torch, for the check alone

    spec = sweep.spec
    base = _tensor_shapes(create_learner(resolve_experiment(spec.preset, spec.overrides)))
    for key, param in spec.space.items():
        probes = param.values if isinstance(param, Choice) else [param.low, param.high]
        for value in probes:
            value = int(value) if isinstance(param, Range) and param.integer else value
            shapes = _tensor_shapes(create_learner(resolve_experiment(spec.preset, {**spec.overrides, key: value})))
            if shapes != base:
                raise InvalidPreset(f"space.{key}", f"cannot be perturbed: {value!r} changes the learner's tensors "
                                    "or its replay memory (a copy loads one member's learner and memory into "
                                    "another's); allowed: settings such as learning rates, coefficients, epochs")


def _tensor_shapes(learner: Any) -> dict[str, Any]:
    def shapes(value: Any) -> Any:
        if hasattr(value, "shape") and hasattr(value, "dtype"):
            return tuple(value.shape)
        if isinstance(value, dict):
            return {key: shapes(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [shapes(item) for item in value]
        return None

    replay = getattr(learner, "replay", None)  # an off-policy member's copy takes the memory as it is stored
    memory = None if replay is None else (type(replay).__name__, replay.spec)
    return {"learner": shapes(learner.state_dict()), "memory": memory}


def recorded_plan(study: optuna.Study, interval: int) -> list[PbtMember] | None:
    stored = study.user_attrs.get(f"{PLAN_ATTR}{interval}")
    return None if stored is None else [PbtMember.model_validate(item) for item in json.loads(stored)]


def record_plan(study: optuna.Study, interval: int, plan: list[PbtMember]) -> list[PbtMember]:
    study.set_user_attr(f"{PLAN_ATTR}{interval}", json.dumps([member.model_dump(mode="json") for member in plan]))
    return plan


def recorded_results(study: optuna.Study, interval: int) -> dict[int, MemberResult]:
    prefix = f"{RESULT_ATTR}{interval}:"
    return {int(key.removeprefix(prefix)): MemberResult.from_json(value)
            for key, value in study.user_attrs.items() if key.startswith(prefix)}


def record_result(study: optuna.Study, result: MemberResult) -> None:
    study.set_user_attr(f"{RESULT_ATTR}{result.interval}:{result.member}", json.dumps(asdict(result)))


def pin_sources(storage: Storage, plan: Sequence[PbtMember]) -> None:
    """Keep each checkpoint a member is to copy until it has (the copier lets it go), whatever
    the source's retention settings."""
    for member in plan:
        if (copy := member.copy_from) is not None:
            copier = member_run_id(member.sweep_id, member.member)
            storage.write(RunLayout(copy.source_run_id).pin(copy.version, copier), b"")


def unpin_sources(storage: Storage, plan: Sequence[PbtMember]) -> None:
    """The interval is over: every copy of it was made (a copier killed before it was made left its pin)."""
    storage.delete([RunLayout(copy.source_run_id).pin(copy.version, member_run_id(member.sweep_id, member.member))
                    for member in plan if (copy := member.copy_from) is not None])
