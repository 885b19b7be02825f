"""The improve loop's state: where a run stands after committing a policy version.

`LoopState` is one immutable value. Each committed checkpoint stores it (`loop_state.json`), and a
resumed run continues from the one it reads back; this module is the only place that writes
or reads it. SYNC and ASYNC runs have the same state, except that an ASYNC run also carries its
stream's position: the next chunk number of each rollout worker and the ledger's counters.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

from gymflow.tasks.training.ledger import Ledger

if TYPE_CHECKING:
    from gymflow.presets.model import Preset

STATE_BLOB = "loop_state.json"  # in every checkpoint


@dataclass(frozen=True)
class StreamPosition:
    """ASYNC: where the rollout stream stands."""

    next_chunk: tuple[int, ...]  # per worker: the number of the next chunk to collect
    ledger: Ledger = field(default_factory=Ledger)

    @classmethod
    def start(cls, workers: int) -> StreamPosition:
        return cls(next_chunk=(0,) * workers)


@dataclass(frozen=True)
class LoopState:
    """Where training stands once `version` is committed."""

    version: int  # the newest committed policy version
    env_steps: int  # collected so far, heatup's included
    next_evaluation: int  # env steps at which the next evaluation is due
    env_cursors: tuple[str | None, ...]  # per worker: the shard whose envs the next rollout continues
    stream: StreamPosition | None = None  # ASYNC only

    @classmethod
    def start(cls, workers: int, first_evaluation: int) -> LoopState:
        """Nothing collected yet: version 0, fresh envs on every worker."""
        return cls(version=0, env_steps=0, next_evaluation=first_evaluation, env_cursors=(None,) * workers)

    def committed(self, next_evaluation: int) -> LoopState:
        """The state once the next version is committed."""
        return replace(self, version=self.version + 1, next_evaluation=next_evaluation)

    def to_json(self) -> bytes:
        """The checkpoint blob `STATE_BLOB`."""
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> LoopState:
        fields = json.loads(data)
        stream = fields["stream"]
        return cls(
            version=fields["version"], env_steps=fields["env_steps"], next_evaluation=fields["next_evaluation"],
            env_cursors=tuple(fields["env_cursors"]),
            stream=None if stream is None else StreamPosition(tuple(stream["next_chunk"]), Ledger(**stream["ledger"])),
        )


@dataclass(frozen=True)
class Budget:
    """The run's clock and what it may spend: env steps collected, or for an offline run (which
    collects nothing) gradient steps. An offline run's every version is the same number of
    gradient steps, so its clock is told by the version alone."""

    total: int
    evaluate_every: int
    train_steps_per_version: int = 0  # offline only

    @classmethod
    def of(cls, preset: Preset) -> Budget:
        schedule = preset.schedule
        if preset.offline:  # presets/validate.py has made sure both are set
            return cls(schedule.total_train_steps, schedule.evaluate_every_train_steps,
                       preset.agent.train_steps_per_iteration)
        return cls(schedule.total_env_steps, schedule.evaluate_every_env_steps)

    @property
    def offline(self) -> bool:
        return self.train_steps_per_version > 0

    @property
    def unit(self) -> str:
        return "gradient steps" if self.offline else "env steps"

    def spent(self, state: LoopState) -> int:
        return state.version * self.train_steps_per_version if self.offline else state.env_steps


def planned_total(preset: Preset) -> int:
    """What the run's clock will read at its end, where that is known before it starts: a SYNC or single
    run collects whole rounds (an off-policy run's heatup one round first), so its env steps budget
    rounds up to them; an ASYNC or offline run's is its budget."""
    from gymflow.agents.algorithms import ALGORITHMS

    budget = Budget.of(preset)
    if preset.offline or preset.distribution.mode == "async":
        return budget.total
    envs, schedule = preset.envs_in_total, preset.schedule
    heatup = 0 if ALGORITHMS[preset.agent.algo].on_policy else math.ceil(schedule.heatup_env_steps / envs) * envs
    per_round = preset.env_steps_per_iteration
    return heatup + math.ceil(max(budget.total - heatup, 0) / per_round) * per_round
