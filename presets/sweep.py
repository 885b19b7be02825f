"""A sweep's specification: a preset, the fields to search and how, seeds per configuration, the
budget; and its checks, all made before any trial starts (one line each, naming the field).

    preset: cartpole-ppo
    overrides: {schedule.total_env_steps: 20000}     # every trial
    space:
      agent.lr: {low: 0.0001, high: 0.003, log: true}
      agent.n_epochs: {values: [4, 10]}
      agent.minibatch_size: {low: 32, high: 256, integer: true}
    sampler: tpe          # grid | random | tpe
    trials: 8             # configurations (grid: every point by default)
    seeds: 3              # runs per configuration: preset seed, +1, +2
    concurrency: 2        # improve runs at once, on one shared Dask cluster
    pruner: median        # none | median | halving

Population-based training (`sampler: pbt`, docs/sweeps.md "Population-based training") trains a
population at once and, every interval, copies the best members into the worst and perturbs the
copies' values:

    sampler: pbt
    pbt: {population: 8, interval: 50000, quantile: 0.25, resample_probability: 0.25}
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gymflow.agents.algorithms import algorithm_of
from gymflow.errors import GymflowError, InvalidPreset
from gymflow.presets.load import load_preset
from gymflow.presets.model import Preset
from gymflow.presets.redaction import redacted

ChoiceValue = bool | int | float | str
# fields a trial may not vary: its seed, name, storage and tracking are the sweep's
_RESERVED_FIELDS = ("seed", "name")
_RESERVED_SECTIONS = ("storage.", "tracking.")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Choice(_Strict):
    """One of these values (the grid sampler walks them all)."""

    values: list[ChoiceValue] = Field(description="The values to try.")


class Range(_Strict):
    """A number between low and high (inclusive); `log` samples its logarithm uniformly."""

    low: float
    high: float
    log: bool = False
    integer: bool = False


class PbtSettings(_Strict):
    """How a population-based sweep exploits and explores (Jaderberg et al. 2017, as Ray Tune's PBT)."""

    population: int = Field(default=4, ge=2, le=256, description="Members trained at once, each one improve run.")
    interval: int = Field(ge=1, description="Env steps (an offline preset: gradient steps) between two decisions: "
                          "every member pauses there, the worst copy the best and perturb their values.")
    quantile: float = Field(default=0.25, gt=0.0, lt=0.5, description="The share of members that exploit "
                            "(the worst) and that are copied (the best).")
    resample_probability: float = Field(default=0.25, ge=0.0, le=1.0, description="A copied value is drawn anew "
                                        "from its range or list with this probability, else perturbed.")
    factors: tuple[float, float] = Field(default=(0.8, 1.2), description="A perturbed number is multiplied by "
                                         "one of these (clamped to its range); a listed value moves to a neighbour.")
    window: int = Field(default=1, ge=1, le=100, description="A member's score: the mean of its newest `window` "
                        "evaluation returns at the interval's end.")

    @field_validator("factors")
    @classmethod
    def _factors_positive(cls, factors: tuple[float, float]) -> tuple[float, float]:
        if min(factors) <= 0:
            raise ValueError(f"perturbation factors must be > 0, not {list(factors)}")
        return factors


class SweepSpec(_Strict):
    preset: str = Field(default="cartpole-ppo", description="A built-in preset name or a preset YAML path.")
    overrides: dict[str, Any] = Field(default_factory=dict,
                                      description="Preset fields set for every trial, as dotted keys.")
    space: dict[str, Choice | Range] = Field(
        description="The preset fields to search, by dotted key: {values: [...]} or {low, high, log, integer}.",
    )
    sampler: Literal["grid", "random", "tpe", "pbt"] = Field(
        default="tpe", description="grid: every combination of values; random; tpe: Optuna's TPE sampler; "
        "pbt: population-based training (see `pbt`).",
    )
    pbt: PbtSettings | None = Field(default=None, description="sampler pbt: the population, the interval, how "
                                    "members exploit and explore.")
    trials: int | None = Field(default=None, ge=1, le=10_000,
                               description="Configurations to try (grid: all of them when empty; else 10).")
    seeds: int = Field(default=3, ge=1, le=100, description="Runs per configuration, seeds preset.seed + 0, 1, ...")
    concurrency: int = Field(default=1, ge=1, le=64, description="Improve runs at once, on one shared Dask cluster.")
    pruner: Literal["none", "median", "halving"] = Field(
        default="none", description="Stop hopeless configurations early from the first seed's evaluations: "
        "Optuna's median or successive-halving pruner.",
    )
    study_storage: str = Field(
        default="sqlite:///gymflow-sweeps.db", min_length=1,
        description="Where the sampler's state survives a crash: an SQLAlchemy URL for Optuna's RDB storage.",
    )
    sampler_seed: int = Field(default=0, ge=0, description="Seeds the sampler: the same spec samples the same trials.")

    @field_validator("space")
    @classmethod
    def _space_not_empty(cls, space: dict[str, Choice | Range]) -> dict[str, Choice | Range]:
        if not space:
            raise ValueError("name at least one preset field to search")
        return space

    def fingerprint(self) -> str:
        """The spec as a canonical string, its credentials masked (it is kept in the study's storage): a
        restarted sweep must be given the same one."""
        unset = {"pbt"} if self.pbt is None else set()  # a spec written before PBT existed keeps its print
        return yaml.safe_dump(redacted(self.model_dump(mode="json", exclude=unset)), sort_keys=True)


@dataclass(frozen=True)
class Sweep:
    """A checked spec: its base preset (with the fixed overrides) and its number of configurations."""

    spec: SweepSpec
    base: Preset
    configurations: int

    def seeds(self) -> list[int]:
        return [self.base.seed + index for index in range(self.spec.seeds)]

    def trial_preset(self, params: Mapping[str, Any]) -> Preset:
        return load_preset(self.spec.preset, {**self.spec.overrides, **params})

    def trial_overrides(self, params: Mapping[str, Any], seed: int) -> dict[str, Any]:
        """The overrides of one run: the fixed ones, the configuration's values and its seed."""
        return {**self.spec.overrides, **params, "seed": seed}


def read_sweep_spec(path: str) -> SweepSpec:
    """A spec from a YAML file; raises InvalidPreset naming the bad field."""
    try:
        with open(path, encoding="utf-8") as stream:
            data = yaml.safe_load(stream)
    except OSError as error:
        raise InvalidPreset("spec", f"cannot read {path!r}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise InvalidPreset("spec", f"{path!r} is not valid YAML: {str(error).splitlines()[0]}") from None
    return sweep_spec(data)


def sweep_spec(data: Any) -> SweepSpec:
    if isinstance(data, SweepSpec):
        return data
    try:
        return SweepSpec.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        loc = first["loc"]
        if "Choice" in loc or "Range" in loc:  # neither form of a searched field fits
            key = loc[1]
            raise InvalidPreset(f"space.{key}", "expected {values: [...]} or {low: L, high: H, log: "
                                f"false, integer: false}}, not {data['space'][key]!r}") from None
        where = ".".join(str(part) for part in loc)
        raise InvalidPreset(where or "spec", first["msg"].removeprefix("Value error, ")) from None


def check_sweep(spec: SweepSpec) -> Sweep:
    """Every check a sweep can fail before its first trial: the preset with the fixed overrides,
    and each searched field: known, searchable, a non-empty range, and every bound or value one
    the field allows."""
    base = load_preset(spec.preset, spec.overrides)
    for key, param in spec.space.items():
        _check_param(spec, key, param)
    if spec.sampler == "pbt" or spec.pbt is not None:
        return Sweep(spec, base, _check_population(spec, base))
    sizes = [len(param.values) for param in spec.space.values() if isinstance(param, Choice)]
    if spec.sampler == "grid":
        ranged = [key for key, param in spec.space.items() if isinstance(param, Range)]
        if ranged:
            raise InvalidPreset(f"space.{ranged[0]}", "the grid sampler needs a list of values, not a range")
        grid = math.prod(sizes)
        if spec.trials is not None and spec.trials > grid:
            raise InvalidPreset("trials", f"{spec.trials} is more than the grid's {grid} configurations")
        return Sweep(spec, base, spec.trials or grid)
    return Sweep(spec, base, spec.trials or 10)


def _check_population(spec: SweepSpec, base: Preset) -> int:
    """A population-based sweep's own checks (what a member's learner can take after a copy is
    checked by tasks/sweep/pbt.py, which builds learners); returns the population."""
    if spec.pbt is None:
        raise InvalidPreset("pbt", "sampler pbt needs its settings: pbt: {population: N, interval: STEPS}")
    if spec.sampler != "pbt":
        raise InvalidPreset("sampler", f"pbt settings are for sampler pbt, not {spec.sampler!r}")
    if spec.trials is not None:
        raise InvalidPreset("trials", "a pbt sweep's members are pbt.population; leave trials out")
    if "seeds" in spec.model_fields_set and spec.seeds != 1:
        raise InvalidPreset("seeds", "each member of a pbt sweep is one run (seed: the preset's seed + the member's "
                            "number); allowed: 1, or repeat the sweep with another seed in overrides")
    if spec.pruner != "none":
        raise InvalidPreset("pruner", "a pbt sweep replaces its worst members by copies instead of pruning them; "
                            "allowed: none")
    total, unit = (base.schedule.total_train_steps, "gradient steps") if base.offline \
        else (base.schedule.total_env_steps, "env steps")
    if spec.pbt.interval >= total:
        raise InvalidPreset("pbt.interval", f"{spec.pbt.interval:,} is not shorter than the budget ({total:,} {unit}); "
                            f"allowed: below {total:,}, so members pause and copy at least once")
    for key in spec.space:
        if not key.startswith("agent."):
            raise InvalidPreset(f"space.{key}", "cannot be perturbed: a member goes on with its envs, schedule and "
                                "workers after a copy; allowed: agent.* fields")
    if base.distribution.mode == "async":
        raise InvalidPreset("distribution.mode", "a pbt sweep's members run in single or sync mode for now: an "
                            "async member's copy would need its stream's position too")
    if not algorithm_of(base.agent).on_policy and not base.storage.checkpoint_replay:
        raise InvalidPreset("storage.checkpoint_replay", f"a {base.agent.algo} member's copy takes the source's "
                            "replay memory from its checkpoint; allowed: true (in the sweep's overrides)")
    return spec.pbt.population


def _check_param(spec: SweepSpec, key: str, param: Choice | Range) -> None:
    field = f"space.{key}"
    if key in _RESERVED_FIELDS or key.startswith(_RESERVED_SECTIONS):
        raise InvalidPreset(field, "cannot be searched: seeds are the sweep's `seeds`, and a run's name, storage "
                            "and tracking are the sweep's; set them in `overrides`")
    if isinstance(param, Choice):
        if not param.values:
            raise InvalidPreset(field, "the list of values is empty")
        probes = list(param.values)
    else:
        if not param.low < param.high:
            raise InvalidPreset(field, f"the range is empty: low {param.low:g} must be below high {param.high:g}")
        if param.log and param.low <= 0:
            raise InvalidPreset(field, f"a log range needs low > 0, not {param.low:g}")
        if param.integer and not (float(param.low).is_integer() and float(param.high).is_integer()):
            raise InvalidPreset(field, f"an integer range needs whole bounds, not {param.low:g}..{param.high:g}")
        cast = int if param.integer else float
        probes = [cast(param.low), cast(param.high)]
    for value in probes:
        try:
            load_preset(spec.preset, {**spec.overrides, key: value})
        except GymflowError as error:
            if error.problem.startswith("unknown"):
                raise InvalidPreset(field, f"no such preset field ({error.problem})") from None
            allowed = error.problem if error.field == key else f"{error.field}: {error.problem}"
            raise InvalidPreset(field, f"{value!r} is not allowed ({allowed})") from None
