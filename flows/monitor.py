"""Watching a registered champion: its policy scored on episodes it has not seen (seeds drawn anew
for each monitoring run), and a Prefect event either way — `gymflow.model.scored`, and
`gymflow.model.degraded` when its mean return is below the threshold. A deployment trigger on
`gymflow.model.degraded` (prefect.yaml: `retrain/cartpole-ppo-degraded`) starts the
retraining with the event's payload as its parameters (docs/deploy.md, "Automations"). The payload's
overrides leave credentials out (keys and URI passwords): the retraining reads its own where the
monitoring run did (a Secret block, its worker's environment), and Prefect stores none."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Annotated

from prefect import get_run_logger
from pydantic import Field

from gymflow.errors import InvalidPreset
from gymflow.flows.parameters import checked_flow, overrides_checked, refusal_said
from gymflow.presets.overrides import PresetOverrides
from gymflow.presets.redaction import redacted_uri, without_credentials
from gymflow.presets.validate import resolve_experiment
from gymflow.tasks.tracking.events import model_scored
from gymflow.tasks.tracking.models import find_champion, mean_return, score_policy
from gymflow.tasks.tracking.servers import check_tracking_server


@dataclass(frozen=True)
class ChampionScore:
    model: str
    version: str
    mean_return: float
    threshold: float
    seed: int  # the episodes' seed, drawn for this monitoring run

    @property
    def degraded(self) -> bool:
        return self.mean_return < self.threshold


@checked_flow(name="monitor", log_prints=True)
def monitor(
    preset: str = "cartpole-ppo",
    overrides: PresetOverrides = PresetOverrides(),  # an empty form, its sections open in Prefect's UI
    model_name: str | None = None,
    threshold: float = 475.0,
    evaluation_episodes: Annotated[int, Field(ge=1, le=1000)] = 20,
) -> ChampionScore:
    """Score the champion of a registered model on fresh episodes; emit `gymflow.model.degraded`
    (and `gymflow.model.scored` either way) with what a retraining needs as its payload.

    Args:
        preset: The preset whose env the champion is scored on, and that a retraining trains: one of the
            built-in presets (breakout-appo, breakout-dqn, breakout-ppo, cartpole-appo, cartpole-bc,
            cartpole-dqn, cartpole-dqn-async, cartpole-po-ppo, cartpole-ppo, catch-appo, catch-dqn, catch-ppo,
            halfcheetah-ppo, halfcheetah-sac, hallway-ppo, hallway-walk-ppo, hopper-iql, hopper-ppo, hopper-td3,
            lunarlander-ppo, mujoco-ppo, pendulum-po-ppo, pendulum-sac, picture-corridor-ppo, pong-appo,
            race-ppo, spread-ippo, spread-mappo; `gymflow presets` says what each trains) or a preset YAML path.
        overrides: Preset fields to change (its tracking URI: where the registry is).
        model_name: The MLflow registered model; empty means gymflow-<preset name>.
        threshold: Below this mean return the champion counts as degraded.
        evaluation_episodes: Episodes to score it on, with seeds drawn for this run.
    """
    with refusal_said():
        changes = overrides_checked(overrides)
        config = resolve_experiment(preset, changes).preset  # bad input stops here
        name = model_name or f"gymflow-{config.name}"
        check_tracking_server(config.tracking.tracking_uri, config.tracking.experiment)
        champion = find_champion(config.tracking.tracking_uri, name)
        if champion is None:
            where = redacted_uri(config.tracking.tracking_uri)
            raise InvalidPreset("model_name", f"{name!r} has no champion at {where}; allowed: a registered model "
                                              "with a champion alias (gymflow retrain makes one)")
    seed = secrets.randbelow(2**31)  # episodes it has not been scored on before
    returns = score_policy(config.tracking.tracking_uri, champion, env=config.env, episodes=evaluation_episodes,
                           seed=seed)
    score = ChampionScore(name, champion.version, mean_return(returns), threshold, seed)
    model_scored(name, score.degraded, {"model": name, "version": champion.version, "mean_return": score.mean_return,
                                        "threshold": threshold, "episodes": evaluation_episodes, "seed": seed,
                                        "preset": preset, "overrides": without_credentials(changes)})
    get_run_logger().info("champion %s v%s: mean return %.2f over %d fresh episodes, %s threshold %g", name,
                          champion.version, score.mean_return, evaluation_episodes,
                          "below its" if score.degraded else "at or above its", threshold)
    return score
