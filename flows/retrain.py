"""Champion/challenger retraining: warm-start from the champion, train, score both on the same
evaluation episodes, promote the challenger only if it wins by a margin."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from mlflow.tracking import MlflowClient
from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from pydantic import Field

from gymflow.envs.seeding import derive_seed
from gymflow.flows.improve import improve
from gymflow.presets.overrides import PresetOverrides, as_dotted
from gymflow.presets.validate import resolve_experiment
from gymflow.tasks.tracking.models import (
    ModelRef,
    find_champion,
    mean_return,
    promote,
    register_challenger,
    score_policy,
)


@dataclass
class RetrainDecision:
    model_name: str
    challenger: ModelRef
    champion: ModelRef | None  # the champion before this run
    challenger_return: float
    champion_return: float | None
    margin: float
    evaluation_seed: int
    episode_seeds: list[int]
    promoted: bool

    @property
    def outcome(self) -> str:
        if self.champion is None:
            return "first champion registered"
        return "challenger promoted" if self.promoted else "champion kept"


@flow(name="retrain", log_prints=True)
def retrain(
    preset: str = "cartpole-ppo",
    overrides: PresetOverrides | None = None,
    model_name: str | None = None,
    margin: Annotated[float, Field(ge=0)] = 0.0,
    evaluation_episodes: Annotated[int, Field(ge=1, le=1000)] = 20,
    warm_start: bool = True,
) -> RetrainDecision:
    """Train a challenger and promote it to champion in the MLflow model registry only if it
    beats the current champion on the same evaluation episodes.

    Args:
        preset: A built-in preset name (cartpole-ppo, cartpole-dqn, cartpole-dqn-async,
            pendulum-sac) or a preset YAML path.
        overrides: Preset fields to change, as a form or as dotted keys ({"agent.lr": 0.0003}).
        model_name: The MLflow registered model; empty means gymflow-<preset name>.
        margin: Promote only if the challenger's mean return beats the champion's by more than this.
        evaluation_episodes: Episodes each policy is scored on, with the same seeds for both.
        warm_start: Start the challenger from the champion's policy.
    """
    experiment = resolve_experiment(preset, as_dotted(overrides))  # bad input stops here
    config = experiment.preset
    tracking_uri = config.tracking.tracking_uri
    name = model_name or f"gymflow-{config.name}"
    logger = get_run_logger()

    champion = find_champion(tracking_uri, name)
    logger.info("champion: %s", champion.uri if champion else "none yet")
    summary = improve(preset, overrides, warm_start=champion.uri if champion and warm_start else None)
    challenger = register_challenger(tracking_uri, name, summary.mlflow_run_id, summary.model_uri)

    seed = derive_seed(config.seed, "retrain-evaluation")
    score = {"model": challenger, "env": config.env, "episodes": evaluation_episodes, "seed": seed}
    challenger_returns = score_policy(tracking_uri, **score)
    champion_returns = score_policy(tracking_uri, **{**score, "model": champion}) if champion else None
    challenger_return = mean_return(challenger_returns)
    champion_return = mean_return(champion_returns) if champion_returns else None
    promoted = champion_return is None or challenger_return > champion_return + margin
    if promoted:
        promote(tracking_uri, challenger)

    decision = RetrainDecision(
        model_name=name,
        challenger=challenger,
        champion=champion,
        challenger_return=challenger_return,
        champion_return=champion_return,
        margin=margin,
        evaluation_seed=seed,
        episode_seeds=[derive_seed(seed, i, 0) for i in range(evaluation_episodes)],
        promoted=promoted,
    )
    _record(decision, tracking_uri, summary.mlflow_run_id)
    logger.info("%s: challenger %.2f vs champion %s", decision.outcome, challenger_return,
                "-" if champion_return is None else f"{champion_return:.2f}")
    return decision


def _record(decision: RetrainDecision, tracking_uri: str, run_id: str) -> None:
    """The decision, both scores and the seeds: on the challenger's MLflow run and as a Prefect
    table artifact."""
    client = MlflowClient(tracking_uri)
    client.log_metric(run_id, "retrain/challenger_return", decision.challenger_return)
    if decision.champion_return is not None:
        client.log_metric(run_id, "retrain/champion_return", decision.champion_return)
    client.log_param(run_id, "retrain.evaluation_seed", decision.evaluation_seed)
    client.log_param(run_id, "retrain.margin", decision.margin)
    client.set_tag(run_id, "gymflow.retrain.outcome", decision.outcome)
    client.set_tag(run_id, "gymflow.retrain.champion_before", decision.champion.uri if decision.champion else "none")
    client.set_tag(run_id, "gymflow.retrain.challenger", decision.challenger.uri)
    client.set_tag(run_id, "gymflow.retrain.episode_seeds", ",".join(map(str, decision.episode_seeds)))
    rows = [
        {"policy": "challenger", "model": decision.challenger.uri, "mean return": round(decision.challenger_return, 3),
         "champion after": "yes" if decision.promoted else "no"},
    ]
    if decision.champion is not None:
        rows.append({"policy": "champion", "model": decision.champion.uri,
                     "mean return": round(decision.champion_return, 3),
                     "champion after": "no" if decision.promoted else "yes"})
    create_table_artifact(
        key="retrain-decision",
        table=rows,
        description=f"{decision.outcome} (margin {decision.margin:g}); both scored on the same "
        f"{len(decision.episode_seeds)} episodes, reset seeds {decision.episode_seeds}",
    )
