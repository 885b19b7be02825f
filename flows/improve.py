"""The improve loop as a Prefect flow: heatup, then train (collect -> learn -> commit -> maybe
evaluate) until the stop rule, then the final evaluation and the delivered policy."""

from __future__ import annotations

import time
from typing import Annotated

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.states import Completed
from pydantic import Field

from gymflow.flows.parameters import checked_flow, overrides_checked, refusal_said
from gymflow.flows.stopping import cancellable, deployment_of_this_run
from gymflow.presets.overrides import PresetOverrides
from gymflow.presets.validate import resolve_experiment
from gymflow.tasks.cluster.placement import rollout_hosts
from gymflow.tasks.sweep.trial import PbtMember, SweepTrial, TrialJudge
from gymflow.tasks.tracking.artifacts import publish_evaluations
from gymflow.tasks.training.delivery import deliver, describe, report_run
from gymflow.tasks.training.loop import train
from gymflow.tasks.training.run import (
    first_state,
    improve_loop,
    prepare_run,
    run_recorder,
    run_tags,
    say_where_it_starts,
    storage_url,
    tracked_run,
)
from gymflow.tasks.training.summary import RunEnding, RunIdentity, RunSummary, summarize

RunId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,119}$")]


@checked_flow(name="improve", log_prints=True)
def improve(
    preset: str = "cartpole-ppo",
    overrides: PresetOverrides = PresetOverrides(),  # an empty form, its sections open in Prefect's UI
    warm_start: str | None = None,
    resume: str | None = None,
    run_id: RunId | None = None,
    sweep_trial: SweepTrial | PbtMember | None = None,
) -> RunSummary:
    """Train a preset: heatup, then rounds of collect -> learn -> evaluate until the step budget
    or the target return.

    Args:
        preset: What to train: one of the built-in presets (breakout-appo, breakout-dqn, breakout-ppo,
            cartpole-appo, cartpole-bc, cartpole-dqn, cartpole-dqn-async, cartpole-po-ppo, cartpole-ppo,
            catch-appo, catch-dqn, catch-ppo, halfcheetah-ppo, halfcheetah-sac, hallway-ppo, hallway-walk-ppo,
            hopper-iql, hopper-ppo, hopper-td3, lunarlander-ppo, mujoco-ppo, pendulum-po-ppo, pendulum-sac,
            picture-corridor-ppo, pong-appo, race-ppo, spread-ippo, spread-mappo; `gymflow presets` says what
            each trains) or a preset YAML path.
        overrides: Preset fields to change, as a form or as dotted keys ({"agent.lr": 0.0003}).
        warm_start: Start from this policy: an MLflow model URI (models:/name@champion) or a
            policy.safetensors path; or from a whole learner (critics and optimisers too): learner:RUN_ID
            (or learner:RUN_ID@vN, a version of it), a run in the same storage (an offline run continued
            online), trained on with this preset's learning rates. Empty starts from scratch.
        resume: The id of a run whose flow died: continue it from its last valid checkpoint to
            its original end, in the same MLflow run. Its preset comes from its storage; only
            storage settings (where to find it) are taken from preset and overrides.
        run_id: The new run's id (default: the preset's name and the time); refused if taken.
        sweep_trial: Set by a sweep: the run's configuration and seed, whose pruner may stop it; or
            a population member's interval: its values, where it pauses, the member it copies.
    """
    with refusal_said():
        experiment = resolve_experiment(preset, changed := overrides_checked(overrides))  # bad input stops here
        member = sweep_trial if isinstance(sweep_trial, PbtMember) else None
        run = prepare_run(experiment, warm_start, resume, run_id, member)  # so does an unusable root or server
    logger = get_run_logger()
    judge = TrialJudge(sweep_trial) if isinstance(sweep_trial, SweepTrial) else None
    with (
        cancellable(flow_run.id, deployment_of_this_run()),  # a Prefect cancellation ends the run within seconds
        rollout_hosts(run.experiment, logger, run.run_id) as (hosts, where),  # a cluster or env unusable: stops here
        tracked_run(run, str(flow_run.id), run_tags(changed, sweep_trial.tags() if sweep_trial else None),
                    alone=sweep_trial is None) as tracker,
    ):
        recorder = run_recorder(run, tracker, logger)
        logger.info("run %s: storage %s, MLflow run %s, %s", run.run_id, storage_url(run), tracker.run_id, where)
        with improve_loop(run, hosts, recorder, logger, judge, earlier=recorder.evaluations) as loop:
            logger.info("run %s: rollout workers ready, training", run.run_id)
            started = time.perf_counter()
            state = first_state(run, hosts, loop, logger)  # heatup and version 0, or where a resumed run stood
            say_where_it_starts(run, state, recorder, logger)  # a resumed run's bar starts where it stood
            while not loop.stopped(state):
                state = train(loop, state)  # ~2 s of collect -> learn -> commit -> maybe evaluate
            finished = loop.finish(state)  # the delivered policy's film is made beside delivery
            state, deciding = finished.state, finished.deciding
            identity = RunIdentity(run.run_id, tracker.run_id, storage_url(run), str(flow_run.id))
            ending = RunEnding(loop.stop.target_reached(deciding), loop.stop.stopped_early(loop.latest),
                               time.perf_counter() - started, run.preset.schedule.target_return,
                               paused=loop.paused(state, deciding))
            summary = summarize(identity, finished, recorder, ending)
            if summary.paused:  # a population member at its interval's end: continued by the sweep
                logger.info("run %s paused at %s %s: v%d scored %.1f; its sweep continues it", run.run_id,
                            f"{summary.clock:,}", recorder.budget.unit, summary.delivered_version, summary.final_return)
                return summary
            delivered = deliver(run, tracker, summary, recorder)  # artifacts, figures, the model
            loop.film_landed()
            summary, report = delivered.summary, report_run(run, tracker, delivered, recorder)
    logger.info("run %s done: %s", run.run_id, describe(summary))
    publish_evaluations(run.run_id, summary.evaluations, recorder.budget.unit)
    create_markdown_artifact(key="improve-summary", markdown=report, description=f"gymflow run {run.run_id}")
    if summary.stopped_early:  # the Prefect UI shows the run as Pruned
        return Completed(name="Pruned", message=f"pruned by the sweep at {judge.pruned_at:,} env steps", data=summary)
    return summary
