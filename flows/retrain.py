"""Champion/challenger retraining: warm-start from the champion, train (collecting, or offline on
the experience logged since the champion was made), score both on the same evaluation episodes,
promote the challenger only if it wins by a margin. On a two-player game (`challenger.judge: match`) the
challenger plays the champion instead: a league whose registry keeps each winner."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from gymnasium import spaces
from prefect import get_run_logger
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel, ConfigDict, Field

from gymflow.agents.match import MatchResult
from gymflow.agents.ope import Estimate, NoSupport
from gymflow.envs.seeding import derive_seed
from gymflow.errors import InvalidPreset
from gymflow.flows.improve import improve
from gymflow.flows.parameters import checked_flow, overrides_checked, refusal_said
from gymflow.presets.model import Preset
from gymflow.presets.overrides import PresetOverrides
from gymflow.presets.validate import Experiment, resolve_experiment
from gymflow.tasks.lake.decision_log import decision_log_location
from gymflow.tasks.lake.off_policy import (
    HeldOutChoice,
    HeldOutDecisions,
    held_out_decisions,
    paired_difference,
    score_off_policy,
)
from gymflow.tasks.tracking.blocks import with_block_options
from gymflow.tasks.tracking.events import model_decided
from gymflow.tasks.tracking.logged import find_logged_experience
from gymflow.tasks.tracking.models import (
    ModelRef,
    find_champion,
    greedy_actions,
    match_policies,
    mean_return,
    promote,
    register_challenger,
    register_onnx_sibling,
    score_policy,
)
from gymflow.tasks.tracking.servers import check_tracking_server
from gymflow.tasks.tracking.store import tracking_client


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
    match: MatchResult | None = None  # judge "match": the challenger's games against the champion
    off_policy: dict[str, dict[str, Estimate]] | None = None  # judge "off_policy": each policy's estimates

    def scores(self) -> str:
        """What decided, in words."""
        if self.match is not None:
            low, high = self.match.interval()
            return (f"the challenger won {self.match.wins}, drew {self.match.draws} and lost {self.match.losses} of "
                    f"{self.match.games} games against the champion: score {self.match.score:.3f} [{low:.3f}, "
                    f"{high:.3f}]")
        if self.off_policy is not None:
            return "; ".join(f"{who} {_said(estimates)}" for who, estimates in self.off_policy.items())
        champion = "-" if self.champion_return is None else f"{self.champion_return:.2f}"
        return f"challenger {self.challenger_return:.2f} vs champion {champion}"

    def event_payload(self) -> dict:
        """What `gymflow.model.promoted` / `kept` carry: both scores, the versions, the margin."""
        return {"outcome": self.outcome, "challenger_return": self.challenger_return,
                "champion_return": self.champion_return, "margin": self.margin,
                "challenger_version": self.challenger.version,
                "champion_version": self.champion.version if self.champion else None,
                "match_score": self.match.score if self.match else None,
                "off_policy": {who: {name: list(estimate) for name, estimate in estimates.items()}
                               for who, estimates in (self.off_policy or {}).items()} or None}

    @property
    def outcome(self) -> str:
        if self.champion is None:
            return "first champion registered"
        return "challenger promoted" if self.promoted else "champion kept"


Judge = Literal["returns", "match", "off_policy"]
JUDGING_ESTIMATOR = "dr"  # judge off_policy: doubly robust, whose interval held the bandit's truth in 58 of 60 logs


def _said(estimates: dict[str, Estimate]) -> str:
    judged = estimates[JUDGING_ESTIMATOR]
    return (f"{JUDGING_ESTIMATOR.upper()} {judged.value:.3f} [{judged.low:.3f}, {judged.high:.3f}] "
            f"(ESS {judged.effective_sample_size:,.0f})")


class ChallengerTraining(BaseModel):
    """How the challenger is trained, and judged."""

    model_config = ConfigDict(extra="forbid")

    warm_start: bool = Field(default=True, description="Start the challenger from the champion's policy.")
    experience: Literal["collect", "logged", "decisions"] = Field(
        default="collect",
        description="collect: the challenger collects its own experience. logged: it learns offline (an off-policy "
        "agent, schedule.total_train_steps) from the shards of the runs of the preset's env in its storage that "
        "were made since the champion was registered. decisions: it learns offline from a served policy's "
        "decision log (decision_log), the held-out share left out.",
    )
    decision_log: str | None = Field(
        default=None, min_length=1,
        description="Where a served policy logged its decisions (GYMFLOW_DECISION_LOG: a folder or an s3:// URL, "
        "read with the preset's storage options): what experience decisions learns from and judge off_policy "
        "weighs.",
    )
    held_out: float = Field(
        default=0.3, ge=0.05, le=0.9,
        description="The share of logged decisions (chosen by request id) the challenger does not learn from and "
        "judge off_policy scores both policies on.",
    )
    judge: Judge = Field(
        default="returns",
        description="returns: the challenger and the champion score their mean returns on the same episodes; "
        "promoted if it wins by more than `margin`. match: for a two-player PettingZoo game (race-ppo), the "
        "challenger plays the champion `evaluation_episodes` games, sides swapped; promoted when its score's 95% "
        "interval (wins and half the draws, per game) lies above 0.5 + margin; its returns are the two scores. "
        "off_policy: no env is played: both policies' values are estimated on the decision log's held-out "
        "decisions (doubly robust, with IPS, SNIPS and the direct method beside it); promoted when the 95% "
        "interval of the challenger's value less the champion's, paired on the same decisions, lies above "
        "`margin`.",
    )


@checked_flow(name="retrain", log_prints=True)
def retrain(
    preset: str = "cartpole-ppo",
    overrides: PresetOverrides = PresetOverrides(),  # an empty form, its sections open in Prefect's UI
    model_name: str | None = None,
    margin: Annotated[float, Field(ge=0)] = 0.0,
    evaluation_episodes: Annotated[int, Field(ge=1, le=1000)] = 20,
    challenger: ChallengerTraining | None = None,
) -> RetrainDecision:
    """Train a challenger and promote it to champion in the MLflow model registry only if it
    beats the current champion on the same evaluation episodes.

    Args:
        preset: What the challenger trains: one of the built-in presets (breakout-appo, breakout-dqn,
            breakout-ppo, cartpole-appo, cartpole-bc, cartpole-dqn, cartpole-dqn-async, cartpole-po-ppo,
            cartpole-ppo, catch-appo, catch-dqn, catch-ppo, halfcheetah-ppo, halfcheetah-sac, hallway-ppo,
            hallway-walk-ppo, hopper-iql, hopper-ppo, hopper-td3, lunarlander-ppo, mujoco-ppo, pendulum-po-ppo,
            pendulum-sac, picture-corridor-ppo, pong-appo, race-ppo, spread-ippo, spread-mappo; `gymflow
            presets` says what each trains) or a preset YAML path.
        overrides: Preset fields to change, as a form or as dotted keys ({"agent.lr": 0.0003}).
        model_name: The MLflow registered model; empty means gymflow-<preset name>.
        margin: Promote only if the challenger's mean return beats the champion's by more than this.
        evaluation_episodes: Episodes each policy is scored on, with the same seeds for both.
        challenger: How the challenger is trained: from the champion's policy or from scratch, on
            experience it collects or on the experience logged since the champion was made; and
            how it is judged: by mean returns, or by a match against the champion.
    """
    training = challenger or ChallengerTraining()
    judge = training.judge
    logger = get_run_logger()
    with refusal_said():
        changes = overrides_checked(overrides)
        experiment = resolve_experiment(preset, changes)  # bad input stops here
        config = experiment.preset
        if judge == "match" and len(getattr(experiment.observation_space, "groups", ())) != 2:
            raise InvalidPreset("challenger.judge", f"match is for two-player PettingZoo envs; {config.env.id!r} is "
                                                    "not one: allowed: returns")
        started = time.time()  # what the log holds now is what the challenger learns from and is judged on
        held = _held_out(training, experiment, started) if judge == "off_policy" else None  # an unusable log stops
        tracking_uri = config.tracking.tracking_uri
        name = model_name or f"gymflow-{config.name}"
        check_tracking_server(tracking_uri, config.tracking.experiment)
        champion = find_champion(tracking_uri, name)
        logger.info("champion: %s", champion.uri if champion else "none yet")
        if training.experience == "logged":
            changes = _offline_on_logged_runs(preset, config, changes, champion)
        elif training.experience == "decisions":
            changes = _offline_on_decisions(preset, changes, _decision_log(training), training.held_out, started)
            if judge == "off_policy":  # the challenger's own evaluations play no env either
                changes = {**changes, "schedule.evaluate_on": "decisions"}
                resolve_experiment(preset, changes)
    summary = improve(preset, changes, warm_start=champion.uri if champion and training.warm_start else None)
    registered = register_challenger(tracking_uri, name, summary.mlflow_run_id, summary.model_uri)
    graph = register_onnx_sibling(tracking_uri, name, summary.mlflow_run_id)  # `<name>-onnx@champion` with it

    seed = derive_seed(config.seed, "retrain-evaluation")
    decision = RetrainDecision(name, registered, champion, 0.0, None, margin, seed,
                               [derive_seed(seed, i, 0) for i in range(evaluation_episodes)], promoted=False)
    if held is not None:
        decision = _judged_off_policy(decision, held, tracking_uri)
    else:
        decision = (_judged_by_match if judge == "match" else _judged_by_returns)(decision, config, tracking_uri)
    if decision.promoted:
        promote(tracking_uri, registered, graph)
    _record(decision, tracking_uri, summary.mlflow_run_id)
    model_decided(name, decision.promoted, decision.event_payload())
    logger.info("%s: %s", decision.outcome, decision.scores())
    return decision


def _judged_by_returns(decision: RetrainDecision, config: Preset, tracking_uri: str) -> RetrainDecision:
    """Both policies scored on the same episodes; the challenger promoted if its mean return beats
    the champion's by more than the margin (or there is no champion)."""
    score = {"env": config.env, "episodes": len(decision.episode_seeds), "seed": decision.evaluation_seed}
    challenger_return = mean_return(score_policy(tracking_uri, decision.challenger, **score))
    if decision.champion is None:
        return replace(decision, challenger_return=challenger_return, promoted=True)
    champion_return = mean_return(score_policy(tracking_uri, decision.champion, **score))
    return replace(decision, challenger_return=challenger_return, champion_return=champion_return,
                   promoted=challenger_return > champion_return + decision.margin)


def _judged_by_match(decision: RetrainDecision, config: Preset, tracking_uri: str) -> RetrainDecision:
    """The challenger plays the champion; promoted if the lower end of its score's interval is
    above 0.5 + margin (the first challenger becomes champion unplayed)."""
    if decision.champion is None:
        return replace(decision, challenger_return=float("nan"), promoted=True)
    match = match_policies(tracking_uri, decision.challenger, decision.champion, config.env,
                           len(decision.episode_seeds), decision.evaluation_seed)
    return replace(decision, challenger_return=match.score, champion_return=1.0 - match.score, match=match,
                   promoted=match.interval()[0] > 0.5 + decision.margin)


def _judged_off_policy(decision: RetrainDecision, held: HeldOutDecisions, tracking_uri: str) -> RetrainDecision:
    """Both policies' values estimated on the held-out decisions, with no env played; the challenger
    promoted if the lower end of the interval of its value less the champion's (paired, on the same
    decisions) is above the margin."""
    observations = held.logged.observations
    acts = {"challenger": greedy_actions(tracking_uri, decision.challenger, observations)}
    if decision.champion is not None:
        acts["champion"] = greedy_actions(tracking_uri, decision.champion, observations)
    try:
        estimates = {who: score_off_policy(actions, held) for who, actions in acts.items()}
        if decision.champion is not None:
            estimates["difference"] = {JUDGING_ESTIMATOR: paired_difference(acts["challenger"], acts["champion"], held)}
    except NoSupport as refused:
        raise InvalidPreset("challenger.decision_log", str(refused)) from None
    difference = estimates.get("difference", {}).get(JUDGING_ESTIMATOR)
    return replace(decision, challenger_return=estimates["challenger"][JUDGING_ESTIMATOR].value, off_policy=estimates,
                   champion_return=estimates["champion"][JUDGING_ESTIMATOR].value if difference else None,
                   promoted=difference is None or difference.low > decision.margin)


def _decision_log(training: ChallengerTraining) -> str:
    if training.decision_log is None:
        raise InvalidPreset("challenger.decision_log", "experience decisions and judge off_policy read a served "
                                                       "policy's decision log: a folder or an s3:// URL")
    return training.decision_log


def _held_out(training: ChallengerTraining, experiment: Experiment, before: float) -> HeldOutDecisions:
    """The log's held-out decisions to judge on, read and checked before any training."""
    if not isinstance(experiment.action_space, spaces.Discrete):
        raise InvalidPreset("challenger.judge", "off_policy weighs discrete actions; this env's are continuous: "
                                                "allowed: returns")
    storage = with_block_options(experiment).preset.storage  # the log's credentials, as the run's workers read it
    location = decision_log_location(_decision_log(training), {}, storage)
    return held_out_decisions(location, HeldOutChoice(training.held_out, "judging", before),
                              int(experiment.action_space.n), ("challenger.decision_log", "challenger.held_out"))


def _offline_on_decisions(preset: str, changes: dict[str, Any], log: str, share: float, before: float
                          ) -> dict[str, Any]:
    """`changes` with the decision log as the dataset (what was logged before `before`), its held-out
    share left out, nothing collected."""
    get_run_logger().info("learning offline from the decisions logged at %s (%.0f%% held out)", log, share * 100)
    changes = {**changes, "dataset.decisions": log, "dataset.holdout": share, "dataset.logged_before": before,
               "dataset.root": None, "schedule.total_env_steps": 0, "schedule.heatup_env_steps": 0}
    resolve_experiment(preset, changes)  # an agent that cannot learn offline stops here, in one line
    return changes


def _offline_on_logged_runs(preset: str, config: Preset, changes: dict[str, Any], champion: ModelRef | None
                            ) -> dict[str, Any]:
    """`changes` with the runs logged since the champion as the dataset, and nothing collected;
    checked before any training."""
    logger = get_run_logger()
    logged = find_logged_experience(config, champion)
    for run_id, why in logged.passed_over.items():
        logger.warning("not learning from run %s: %s", run_id, why)
    logger.info("learning offline from %d run(s): %s", len(logged.run_ids), ", ".join(logged.run_ids))
    changes = {**changes, "dataset.id": None, "dataset.runs": logged.run_ids, "dataset.root": None,
               "dataset.options": {}, "schedule.total_env_steps": 0, "schedule.heatup_env_steps": 0}
    resolve_experiment(preset, changes)  # an agent that cannot learn offline stops here, in one line
    return changes


def _record(decision: RetrainDecision, tracking_uri: str, run_id: str) -> None:
    """The decision, both scores and the seeds: on the challenger's MLflow run and as a Prefect
    table artifact."""
    client = tracking_client(tracking_uri)
    client.log_metric(run_id, "retrain/challenger_return", decision.challenger_return)
    if decision.champion_return is not None:
        client.log_metric(run_id, "retrain/champion_return", decision.champion_return)
    client.log_param(run_id, "retrain.evaluation_seed", decision.evaluation_seed)
    client.log_param(run_id, "retrain.margin", decision.margin)
    client.set_tag(run_id, "gymflow.retrain.outcome", decision.outcome)
    client.set_tag(run_id, "gymflow.retrain.champion_before", decision.champion.uri if decision.champion else "none")
    client.set_tag(run_id, "gymflow.retrain.challenger", decision.challenger.uri)
    client.set_tag(run_id, "gymflow.retrain.episode_seeds", ",".join(map(str, decision.episode_seeds)))
    for who, estimates in (decision.off_policy or {}).items():  # judge off_policy: every estimator, its interval
        for name, estimate in estimates.items():
            for key, value in zip(("", "_low", "_high", "_ess"), estimate, strict=True):
                client.log_metric(run_id, f"retrain/ope_{who}_{name}{key}", value)
    if decision.match is not None:  # the league's history: each challenger's match, on its run and its model version
        low, high = decision.match.interval()
        for key, value in (("wins", decision.match.wins), ("draws", decision.match.draws),
                           ("losses", decision.match.losses), ("score_low", low), ("score_high", high)):
            client.log_metric(run_id, f"retrain/match_{key}", value)
        client.set_model_version_tag(decision.model_name, decision.challenger.version, "gymflow.match",
                                     f"{decision.outcome} against v{decision.champion.version}: {decision.scores()}")
    scored = "match score" if decision.match else "estimated value (DR)" if decision.off_policy else "mean return"
    rows = [
        {"policy": "challenger", "model": decision.challenger.uri, scored: round(decision.challenger_return, 3),
         "champion after": "yes" if decision.promoted else "no"},
    ]
    if decision.champion is not None:
        rows.append({"policy": "champion", "model": decision.champion.uri,
                     scored: round(decision.champion_return, 3),
                     "champion after": "no" if decision.promoted else "yes"})
    create_table_artifact(
        key="retrain-decision",
        table=rows,
        description=f"{decision.outcome} (margin {decision.margin:g}); "
        + _how_scored(decision),
    )


def _how_scored(decision: RetrainDecision) -> str:
    if decision.match:
        return f"{decision.scores()}; game seeds {decision.episode_seeds}"
    if decision.off_policy:
        return f"{decision.scores()}; no env played: estimated on held-out logged decisions"
    return f"both scored on the same {len(decision.episode_seeds)} episodes, reset seeds {decision.episode_seeds}"
