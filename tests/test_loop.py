"""The improve loop in-process, in milliseconds: its jobs run in this process (gymflow.testing's
InProcessHosts), on a local storage folder, with no Prefect, Dask or MLflow. The same loop,
collections, stop rule and evaluation schedule as the flow; tests/test_improve_flow.py runs
them end to end."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gymflow.tasks.cluster.rounds import RoundPlan
from gymflow.tasks.storage.checkpoints import read_checkpoint, read_policy
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.training.commits import Commits
from gymflow.tasks.training.evaluation import EvaluationSchedule, Scored
from gymflow.tasks.training.learning import create_learner
from gymflow.tasks.training.ledger import Ledger
from gymflow.tasks.training.loop import StopRule
from gymflow.tasks.training.resume import restore
from gymflow.tasks.training.run import PreparedRun, first_state, improve_loop
from gymflow.tasks.training.state import Budget, LoopState, StreamPosition
from gymflow.testing.hosts import InProcessHosts
from tests.in_process import LOGGER, Recording, prepared, train_in_process
from tests.stored import read_ledger

# the loop's heatup and evaluations are Prefect tasks: they run as task runs of the session's API
pytestmark = pytest.mark.usefixtures("prefect_api")


def _policy(run: PreparedRun, version: int) -> bytes:
    return read_policy(run.storage, RunLayout(run.run_id), version, ["policy.safetensors"])["policy.safetensors"]


def test_sync_rounds_collect_learn_commit_and_evaluate_on_schedule(tiny_budget, tmp_path):
    run = prepared(tmp_path, "cartpole-ppo", tiny_budget)  # 128 env steps a round, 640 in all
    state, observer, deciding = train_in_process(run)
    assert [r.state.env_steps for r in observer.reports] == [128, 256, 384, 512, 640]
    assert [r.state.version for r in observer.reports] == [1, 2, 3, 4, 5]
    assert state == observer.reports[-1].state
    # due at 256 env steps, then every 256: versions 2 and 4 are scored beside their rounds, and waited for;
    # no target reached, so the last version's own evaluation decides the run
    assert [(e.step, e.version) for e in observer.evaluations] == [(256, 2), (512, 4), (640, 5)]
    assert deciding is observer.evaluations[-1]
    stored = read_checkpoint(run.storage, RunLayout(run.run_id), 5, ["loop_state.json"])
    assert LoopState.from_json(stored["loop_state.json"]) == state
    assert state.env_cursors == tuple(RunLayout(run.run_id).shard(4, w) for w in (0, 1))


def test_a_target_reached_stops_the_run_at_the_version_that_reached_it(tiny_budget, tmp_path):
    run = prepared(tmp_path, "cartpole-ppo", {**tiny_budget, "schedule.target_return": -1000.0})
    state, observer, deciding = train_in_process(run)
    assert deciding.version == 2  # the first evaluation reaches it
    assert state.version == 3 and len(observer.reports) == 3  # the round it ran beside was committed


def test_a_run_that_reached_its_target_at_a_periodic_evaluation_films_that_version(tiny_budget, tmp_path):
    run = prepared(tmp_path, "cartpole-ppo", {**tiny_budget, "schedule.target_return": -1000.0})
    observer, hosts = Recording(), InProcessHosts()
    with improve_loop(run, hosts, observer, LOGGER) as loop:
        state = first_state(run, hosts, loop, LOGGER)
        while not loop.stopped(state):
            state = loop.step(state)
        state, decided, delivered = loop.finish(state)
        loop.film_landed()
    assert decided in observer.evaluations and decided.version == 2  # no evaluation of its own: the periodic one decides
    assert delivered == decided.standing()
    (filmed,) = observer.films
    assert filmed.version == 2 and filmed.result.film.frames > 1
    assert run.storage.exists(RunLayout(run.run_id).video(2))


def test_a_checkpoint_is_committed_only_once_mlflow_holds_every_step_and_evaluation_before_it(
        tiny_budget, tmp_path, monkeypatch):
    """A run resumed from a checkpoint logs nothing before it again: a kill right after a checkpoint
    lost the rows of its step and the evaluation that finished in it, when they were still queued."""
    from gymflow.tasks.tracking.progress import ProgressLog
    from gymflow.tasks.tracking.tracker import Tracker, evaluation_histories
    from gymflow.tasks.training import commits
    from gymflow.tasks.training.summary import RunRecorder

    run = prepared(tmp_path, "cartpole-ppo", {**tiny_budget, "storage.checkpoint_every_env_steps": 128})
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "loop", "run", {})
    budget = Budget.of(run.preset)
    recorder = RunRecorder(tracker, ProgressLog(LOGGER, budget.total), budget)
    held_at_checkpoint = []
    commit_checkpoint = commits.commit_checkpoint

    def looked_at_first(storage, layout, version, blobs):
        state = LoopState.from_json(blobs["loop_state.json"])
        logged = {m.step for m in tracker.client.get_metric_history(tracker.run_id, "time/env_steps")}
        evaluated = set(evaluation_histories(tracker.client, tracker.run_id)[0])
        held_at_checkpoint.append((state.env_steps, state.env_steps in logged or state.env_steps == 0,
                                   {row.env_steps for row in recorder.evaluations} <= evaluated))
        return commit_checkpoint(storage, layout, version, blobs)

    monkeypatch.setattr(commits, "commit_checkpoint", looked_at_first)
    hosts = InProcessHosts()
    with improve_loop(run, hosts, recorder, LOGGER) as loop:
        state = first_state(run, hosts, loop, LOGGER)
        while not loop.stopped(state):
            state = loop.step(state)
    tracker.finish("FINISHED")
    assert [steps for steps, *_ in held_at_checkpoint] == [0, 128, 256, 384, 512, 640]
    assert all(step_logged and evaluations_logged for _, step_logged, evaluations_logged in held_at_checkpoint)
    assert [row.env_steps for row in recorder.evaluations] == [256, 512]  # finished in steps that checkpointed


def test_stop_rule_needs_the_budget_and_nothing_left_to_learn_or_the_target():
    rule = StopRule(Budget(total=1000, evaluate_every=100), target_return=100.0)
    state = LoopState(3, 1000, 2000, (None,))
    assert rule.reached(state, drained=True, latest=None)
    assert not rule.reached(state, drained=False, latest=None)
    assert not rule.reached(LoopState(3, 999, 2000, (None,)), drained=True, latest=None)
    from gymflow.tasks.cluster.messages import EvaluationResult

    scored = Scored(500, EvaluationResult(2, (100.0, 101.0), (5, 5), 0.1))
    assert rule.reached(LoopState(3, 10, 2000, (None,)), drained=False, latest=scored)
    assert not StopRule(Budget(1000, 100), None).target_reached(scored)


def test_one_evaluation_runs_at_a_time_and_the_schedule_moves_on_when_one_starts(tiny_budget, tmp_path):
    run = prepared(tmp_path, "cartpole-ppo", tiny_budget)
    Commits(run.storage, run.run_id, run.preset.storage, policy_window=1).publish(run.learner, 0)
    schedule = EvaluationSchedule(InProcessHosts(), RoundPlan(run.preset, run.run_id), Budget.of(run.preset),
                                  blocking=False, logger=LOGGER)
    try:
        assert schedule.start_if_due(LoopState(0, 100, 256, (None, None))) == 256  # not due yet
        assert schedule.wait() is None
        assert schedule.start_if_due(LoopState(0, 300, 256, (None, None))) == 512  # due: version 0 is scored
        assert schedule.start_if_due(LoopState(0, 600, 512, (None, None))) == 512  # one at a time
        scored = schedule.wait()
        assert (scored.step, scored.version, len(scored.result.returns)) == (300, 0, 4)
        assert schedule.finished() is None
    finally:
        schedule.close()


def test_a_resumed_sync_run_ends_with_the_same_weights_and_replay_as_an_uninterrupted_one(tiny_budget, tmp_path):
    dqn = {**tiny_budget, "agent.train_steps_per_iteration": 8, "agent.hidden_sizes": [16],
           "schedule.total_env_steps": 1280, "schedule.heatup_env_steps": 0}
    clean = prepared(tmp_path / "clean", "cartpole-dqn", dqn)
    clean_state, _, _ = train_in_process(clean)
    died = prepared(tmp_path / "died", "cartpole-dqn", dqn)
    train_in_process(died, steps=4)  # the flow dies after committing version 4
    learner = create_learner(died.experiment)
    restored = restore(died.storage, died.run_id, learner, died.preset)
    assert restored.state.version == 4 and restored.refused == ()
    resumed = PreparedRun(died.experiment, died.run_id, died.storage, learner, restored)
    state, _, _ = train_in_process(resumed)
    assert state == clean_state  # version, env steps, next evaluation, where every worker's envs stand
    assert _policy(resumed, state.version) == _policy(clean, clean_state.version)
    for mine, theirs in zip(learner.replay.state_dict().values(), clean.learner.replay.state_dict().values()):
        assert (mine == theirs).all()


def test_async_trains_at_its_ratio_and_accounts_for_every_chunk_once(async_budget, tmp_path):
    run = prepared(tmp_path, "cartpole-dqn", {**async_budget, "schedule.heatup_env_steps": 0})
    state, observer, _ = train_in_process(run)
    ledger = read_ledger(run.storage, run.run_id)
    chunks = run.storage.list(f"{RunLayout(run.run_id).prefix}/shards/async")
    accounted = [*ledger.inserted, *ledger.dropped, *ledger.unused]
    assert sorted(accounted) == chunks and len(set(accounted)) == len(accounted)
    assert state.env_steps >= run.preset.schedule.total_env_steps
    # the learner sampled what the ratio allows, to within one batch
    owed = run.preset.samples_per_insert * ledger.counts.inserted_steps - ledger.counts.sampled
    assert 0 <= owed < run.preset.agent.batch_size
    train_steps = sum(r.metrics.get("train/train_steps", 0) > 0 for r in observer.reports)
    assert train_steps and all(r.metrics["async/samples_per_insert"] <= run.preset.samples_per_insert + 1
                               for r in observer.reports)


def test_the_lag_bound_drops_what_a_policy_too_far_behind_collected(async_budget, tmp_path):
    run = prepared(tmp_path, "cartpole-dqn", {**async_budget, "schedule.heatup_env_steps": 0,
                                               "distribution.max_policy_lag": 1})
    hosts = InProcessHosts()
    with improve_loop(run, hosts, Recording(), LOGGER) as loop:
        state = first_state(run, hosts, loop, LOGGER)  # version 0 is the only policy the workers can load
        experience = loop.collection.collect(replace(state, version=2))  # as if the learner were at version 2
    ledger, pending = experience.state.stream.ledger, loop.collection.book.pending
    assert experience.landed and experience.shards == () and ledger.shards_inserted == 0
    assert ledger.shards_dropped == len(experience.landed) == len(pending)
    assert {(r.key, r.lag, r.admitted) for r in pending} == {(shard.key, 2, False) for shard in experience.landed}
    assert experience.train_steps == 0 and experience.metrics["async/shards_dropped"] == ledger.shards_dropped


def test_the_loop_state_round_trips_through_its_checkpoint_blob():
    ledger = Ledger(shards_inserted=2, shards_dropped=1, shards_unused=1, inserted_steps=96, sampled=320, lag_sum=3,
                    lag_max=2)
    state = LoopState(7, 1234, 2048, ("k0", None), StreamPosition((3, 4), ledger))
    assert LoopState.from_json(state.to_json()) == state
    assert LoopState.from_json(LoopState.start(2, 100).to_json()) == LoopState.start(2, 100)


def test_in_process_hosts_run_a_rounds_rollouts_as_one_job(tiny_budget, tmp_path):
    run = prepared(tmp_path, "cartpole-ppo", tiny_budget)
    hosts = InProcessHosts()
    with improve_loop(run, hosts, Recording(), LOGGER) as loop:
        loop.step(first_state(run, hosts, loop, LOGGER))
    assert hosts.jobs == [("run_rollouts", 0)]  # one round: its two workers' rollouts, stepped together


@pytest.mark.parametrize(("preset", "overrides"), [
    ("cartpole-ppo", {"schedule.total_env_steps": 600}),  # 5 rounds of 128
    ("cartpole-dqn", {"schedule.total_env_steps": 600, "schedule.heatup_env_steps": 100,
                      "agent.train_steps_per_iteration": 2}),  # heatup's round of 13 steps x 8 envs, then 4 of 128
])
def test_the_planned_total_is_what_a_sync_run_collects_so_progress_never_passes_it(tiny_budget, tmp_path, preset,
                                                                                    overrides):
    from gymflow.tasks.training.state import planned_total

    run = prepared(tmp_path, preset, {**tiny_budget, **overrides})
    state, _, _ = train_in_process(run)
    assert state.env_steps == planned_total(run.preset) == (640 if preset == "cartpole-ppo" else 104 + 512)
