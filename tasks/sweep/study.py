"""A sweep's memory: an Optuna study in an RDB (SQLite by default), which outlives the sweep's
process. Each Optuna trial is one configuration; its seeds' runs are recorded on it as they end
(user attributes `seed:N`), so a restarted sweep knows which runs are done, which to resume and
which to start, and the sampler sees every finished configuration again.

Determinism: configurations are asked in waves (as many as `concurrency` runs can take), and the
sampler is seeded afresh before each ask from the sweep's seed and the trial's number, so the
same spec asks the same configurations whether or not the sweep was killed in between (for
SYNC presets, whose runs are deterministic).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from gymflow.envs.seeding import derive_seed
from gymflow.errors import InvalidPreset
from gymflow.presets.sweep import Choice, Sweep, SweepSpec
from gymflow.tasks.sweep.aggregate import area_under_curve
from gymflow.tasks.training.summary import RunSummary

SPEC_ATTR = "gymflow.spec"
PRUNED_AT_ATTR = "pruned_at"
SEED_ATTR_PREFIX = "seed:"


@dataclass(frozen=True)
class SeedResult:
    """One finished run of a configuration."""

    seed: int
    run_id: str
    mlflow_run_id: str
    final_return: float
    area_under_curve: float
    curve: tuple[tuple[int, float], ...]  # (env steps, mean evaluation return) of each evaluation
    pruned: bool = False

    @classmethod
    def of(cls, seed: int, summary: RunSummary, total_env_steps: int) -> SeedResult:
        curve = tuple((row.env_steps, row.mean) for row in summary.evaluations)
        area = area_under_curve([steps for steps, _ in curve], [value for _, value in curve], total_env_steps)
        return cls(seed, summary.run_id, summary.mlflow_run_id, float(summary.final_return), area, curve,
                   summary.stopped_early)

    def as_attr(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_attr(cls, data: Mapping[str, Any]) -> SeedResult:
        return cls(**{**data, "curve": tuple((int(steps), float(value)) for steps, value in data["curve"])})


@dataclass(frozen=True)
class Configuration:
    """An Optuna trial: the values tried, and what its seeds' runs gave."""

    number: int
    trial_id: int
    params: dict[str, Any]
    state: TrialState
    results: dict[int, SeedResult] = field(default_factory=dict)
    pruned_at: int | None = None  # env steps of the first seed's evaluation that pruned it

    def run_id(self, sweep_id: str, seed: int) -> str:
        return f"{sweep_id}-c{self.number:03d}-s{seed}"

    @property
    def pruned(self) -> bool:
        return self.pruned_at is not None or self.state == TrialState.PRUNED


def open_study(sweep: Sweep, sweep_id: str) -> optuna.Study:
    """The sweep's study, created on its first start; a restart must bring the same spec."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spec = sweep.spec
    try:
        study = optuna.create_study(storage=spec.study_storage, study_name=sweep_id, direction="maximize",
                                    load_if_exists=True, pruner=make_pruner(spec.pruner))
    except Exception as error:  # noqa: BLE001 (SQLAlchemy's and Optuna's errors, one line to the user)
        raise InvalidPreset("study_storage", f"cannot open {spec.study_storage!r}: "
                            f"{str(error).splitlines()[0]}") from None
    stored = study.user_attrs.get(SPEC_ATTR)
    if stored is None:
        study.set_user_attr(SPEC_ATTR, spec.fingerprint())
    elif stored != spec.fingerprint():
        raise InvalidPreset("spec", f"sweep {sweep_id!r} was started with another spec; restart it with the same "
                            "one, or give a new sweep id")
    return study


def make_pruner(name: str) -> optuna.pruners.BasePruner:
    """none, median (below the median of earlier configurations at the same env step; from the
    second configuration on), or halving (successive halving)."""
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0)
    if name == "halving":
        return optuna.pruners.SuccessiveHalvingPruner()
    return optuna.pruners.NopPruner()


def make_sampler(spec: SweepSpec, trial_number: int) -> optuna.samplers.BaseSampler:
    """The sampler for one ask. The grid's points are enqueued in order (grid_point), so any
    sampler leaves them as they are."""
    seed = derive_seed(spec.sampler_seed, "sweep-sampler", trial_number)
    if spec.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    return optuna.samplers.RandomSampler(seed=seed)


def grid_point(spec: SweepSpec, number: int) -> dict[str, Any]:
    """The grid's `number`th configuration, the first field's values varying slowest."""
    lists = {key: param.values for key, param in spec.space.items() if isinstance(param, Choice)}  # a grid's all
    return dict(zip(lists, list(itertools.product(*lists.values()))[number]))


def distributions(spec: SweepSpec) -> dict[str, BaseDistribution]:
    found: dict[str, BaseDistribution] = {}
    for key, param in spec.space.items():
        if isinstance(param, Choice):
            found[key] = CategoricalDistribution(param.values)
        elif param.integer:
            found[key] = IntDistribution(int(param.low), int(param.high), log=param.log)
        else:
            found[key] = FloatDistribution(param.low, param.high, log=param.log)
    return found


def configurations(study: optuna.Study) -> list[Configuration]:
    """Every configuration asked so far, in the order they were asked."""
    return [_configuration(trial) for trial in study.get_trials(deepcopy=False)]


def _configuration(trial: optuna.trial.FrozenTrial) -> Configuration:
    results = {int(key.removeprefix(SEED_ATTR_PREFIX)): SeedResult.from_attr(json.loads(value))
               for key, value in trial.user_attrs.items() if key.startswith(SEED_ATTR_PREFIX)}
    return Configuration(trial.number, trial._trial_id, dict(trial.params), trial.state, results,
                         trial.user_attrs.get(PRUNED_AT_ATTR))


def next_wave(study: optuna.Study, sweep: Sweep) -> list[Configuration]:
    """What to run next: the configurations a killed sweep left running, or new ones (as many
    as `concurrency` runs take, within the budget); empty when the sweep is done."""
    asked = configurations(study)
    unfinished = [configuration for configuration in asked if configuration.state == TrialState.RUNNING]
    if unfinished:
        return unfinished
    budget = sweep.configurations - len(asked)
    count = min(budget, max(1, math.ceil(sweep.spec.concurrency / sweep.spec.seeds)))
    wave = []
    for _ in range(max(count, 0)):
        number = len(asked) + len(wave)
        if sweep.spec.sampler == "grid":
            study.enqueue_trial(grid_point(sweep.spec, number))
        study.sampler = make_sampler(sweep.spec, number)
        trial = study.ask(distributions(sweep.spec))
        wave.append(Configuration(trial.number, trial._trial_id, dict(trial.params), TrialState.RUNNING))
    return wave


def record_result(study: optuna.Study, configuration: Configuration, result: SeedResult) -> None:
    study._storage.set_trial_user_attr(configuration.trial_id, f"{SEED_ATTR_PREFIX}{result.seed}",
                                       json.dumps(result.as_attr()))


def finish_configuration(study: optuna.Study, configuration: Configuration, objective: float | None) -> None:
    """Tell Optuna how the configuration ended: its objective, pruned, or failed (None)."""
    trial = study._storage.get_trial(configuration.trial_id)
    if trial.state != TrialState.RUNNING:
        return
    if configuration.pruned:
        study.tell(configuration.number, state=TrialState.PRUNED)
    elif objective is None or not math.isfinite(objective):
        study.tell(configuration.number, state=TrialState.FAIL)
    else:
        study.tell(configuration.number, objective)


def refreshed(study: optuna.Study, configuration: Configuration) -> Configuration:
    """The configuration as the study holds it now (one trial read, not the whole study)."""
    return _configuration(study._storage.get_trial(configuration.trial_id))
