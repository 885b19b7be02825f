"""What an improve run needs to know when it is one seed of a sweep's configuration: where to
report its evaluations (the configuration's first seed reports them to Optuna, whose pruner may
end it), and which MLflow run is its parent; or when it is a member of a population-based sweep:
where it pauses, the values it trains with, and the member it copies first."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gymflow.tasks.training.evaluation import Scored

if TYPE_CHECKING:
    from gymflow.tasks.tracking.tracker import Tracker


class SweepTrial(BaseModel):
    """An improve run's place in a sweep (a flow parameter of `improve`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sweep_id: str = Field(min_length=1)
    study_storage: str = Field(min_length=1, description="The sweep's Optuna storage (SQLAlchemy URL).")
    trial_id: int = Field(ge=0, description="The Optuna trial of the configuration.")
    configuration: int = Field(ge=0, description="The configuration's number in the sweep.")
    seed: int = Field(ge=0)
    reports: bool = Field(description="This run's evaluations are the configuration's, for the pruner.")
    pruner: Literal["none", "median", "halving"] = "none"
    mlflow_parent_run_id: str | None = None

    def tags(self) -> dict[str, str]:
        """MLflow tags of the run: its parent (the MLflow UI nests it there) and its place."""
        tags = {"gymflow.sweep_id": self.sweep_id, "gymflow.sweep.configuration": str(self.configuration),
                "gymflow.sweep.seed": str(self.seed)}
        if self.mlflow_parent_run_id:
            tags["mlflow.parentRunId"] = self.mlflow_parent_run_id
        return tags


class PbtCopy(BaseModel):
    """An exploit: a member's learner replaced by another member's, as that one paused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: int = Field(ge=0, description="The member copied.")
    source_run_id: str = Field(min_length=1)
    version: int = Field(ge=0, description="The source's checkpoint where it paused.")
    at_version: int = Field(ge=0, description="The copier's checkpoint where it paused: the copy is made only "
                            "while that is its newest (a restarted sweep never copies twice).")
    settings_before: dict[str, Any] = Field(default_factory=dict, description="The copier's values until now.")


class PbtMember(BaseModel):
    """An improve run's place in a population-based sweep, for one interval (a flow parameter of
    `improve`): the values it trains with, where it pauses (None: the budget's end), and the copy
    it starts the interval with."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sweep_id: str = Field(min_length=1)
    member: int = Field(ge=0)
    interval: int = Field(ge=0, description="The interval's number, from 0.")
    pause_at: int | None = Field(default=None, ge=1, description="The run's clock (env steps; offline: gradient "
                                 "steps) at which it pauses, checkpointed and scored, to be continued.")
    settings: dict[str, Any] = Field(default_factory=dict, description="The searched fields' values, dotted.")
    copy_from: PbtCopy | None = None
    mlflow_parent_run_id: str | None = None

    def tags(self) -> dict[str, str]:
        tags = {"gymflow.sweep_id": self.sweep_id, "gymflow.pbt.member": str(self.member)}
        if self.mlflow_parent_run_id:
            tags["mlflow.parentRunId"] = self.mlflow_parent_run_id
        return tags


class TrialJudge:
    """Ends a sweep's run early once its configuration is pruned: the reporting seed reports each
    evaluation (step = env steps) and asks the pruner; the other seeds look whether it was pruned.
    Each evaluation is judged once."""

    def __init__(self, trial: SweepTrial):
        import optuna  # only runs inside a sweep pay for it

        from gymflow.tasks.sweep.study import make_pruner

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.link = trial
        self.study = optuna.load_study(study_name=trial.sweep_id, storage=trial.study_storage,
                                       pruner=make_pruner(trial.pruner))
        self.trial = optuna.trial.Trial(self.study, trial.trial_id)
        # a resumed run evaluates again the versions after its checkpoint: the steps its stopped start reported
        # are not reported twice (Optuna ignores such a report, with a warning on the terminal)
        self._reported = set(self.study._storage.get_trial(trial.trial_id).intermediate_values)
        self._judged: tuple[int, bool] | None = None  # (version, verdict)
        self.pruned_at: int | None = None

    def should_stop(self, evaluation: Scored) -> bool:
        if self._judged is not None and self._judged[0] == evaluation.version:
            return self._judged[1]
        verdict = self._judge(evaluation)
        self._judged = (evaluation.version, verdict)
        return verdict

    def _judge(self, evaluation: Scored) -> bool:
        from gymflow.tasks.sweep.study import PRUNED_AT_ATTR

        storage = self.study._storage
        if self.link.reports:
            if evaluation.step not in self._reported:
                self.trial.report(evaluation.mean_return, step=evaluation.step)
                self._reported.add(evaluation.step)
            if not self.trial.should_prune():
                return False
            storage.set_trial_user_attr(self.link.trial_id, PRUNED_AT_ATTR, evaluation.step)
            self.pruned_at = evaluation.step
            return True
        pruned_at = storage.get_trial_user_attrs(self.link.trial_id).get(PRUNED_AT_ATTR)
        self.pruned_at = pruned_at
        return pruned_at is not None



def log_member_interval(tracker: Tracker, member: PbtMember, step: int) -> None:
    """A population member's values from this interval on, as metrics `pbt/FIELD` at the run's
    clock (their schedule, plotted by the MLflow UI), and its copy as an event: the artifact
    `pbt/interval-NNN.json` (the member and version copied, the values before and after)."""
    numbers = {f"pbt/{key}": float(value) for key, value in member.settings.items()
               if isinstance(value, int | float) and not isinstance(value, bool)}
    numbers["pbt/interval"] = float(member.interval)
    copy = member.copy_from
    if copy is not None:
        numbers["pbt/copied_from_member"] = float(copy.source)
        event = {"interval": member.interval, "env_steps": step, "copied_member": copy.source,
                 "copied_run_id": copy.source_run_id, "copied_version": copy.version,
                 "replaced_version": copy.at_version, "settings_before": copy.settings_before,
                 "settings_after": member.settings}
        tracker.log_bytes(json.dumps(event, indent=1).encode(), "pbt", f"interval-{member.interval:03d}.json")
    tracker.log_metrics(numbers, step=step)
