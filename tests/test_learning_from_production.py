"""Learning from what a deployed policy did: a policy served by `mlflow models serve` as a deployment
that explores and logs every decision answers thousands of concurrent requests, each under a
request id its caller reports the outcome under; every decision and outcome is stored, joined, and
carries the probability the served policy acted with."""

from __future__ import annotations

import signal
import threading
import time
import uuid

import mlflow
import numpy as np
import pytest
import requests
from mlflow.tracking import MlflowClient

from gymflow.agents.exploration import epsilon_greedy_probabilities
from gymflow.tasks.lake.decision_log import Outcome, open_decision_log, read_logged
from gymflow.tasks.storage.objects import Storage, StorageLocation
from gymflow.tasks.tracking.models import save_policy_model
from gymflow.testing.policies import untrained_policy_model
from tests.serving import served

CALLERS, REQUESTS_EACH = 16, 200


def _call(invocations: str, caller: int, answers: dict[str, tuple], reporter) -> None:
    """One client: a request an observation, then the outcome of each decision under its request id."""
    rng = np.random.default_rng(caller)
    with requests.Session() as session:
        for _ in range(REQUESTS_EACH):
            observation = rng.normal(size=4).astype(np.float32)
            answer = session.post(invocations, json={"inputs": [observation.tolist()]}, timeout=60)
            answer.raise_for_status()
            predicted = answer.json()["predictions"]
            (request,), (action,) = predicted["request_ids"], predicted["actions"]
            answers[request] = (observation, action)
            reporter.observed(Outcome(request, float(action), observation + 1, False, time.time()))


def test_a_served_policy_logs_every_decision_of_concurrent_callers_and_every_outcome_they_report(tmp_path):
    save_policy_model(untrained_policy_model("cartpole-ppo", version=3), str(tmp_path / "model"))
    log = tmp_path / f"decisions-{uuid.uuid4().hex[:6]}"
    settings = {"GYMFLOW_DECISION_LOG": str(log), "GYMFLOW_EXPLORATION": "epsilon=0.2",
                "GYMFLOW_DECISION_FLUSH_S": "3600"}  # full shards meanwhile, the rest as the server stops
    answers: dict[str, tuple] = {}
    reporter = open_decision_log(str(log))  # the application's side: outcomes, later, by request id
    with served(str(tmp_path / "model"), f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path,
                settings=settings) as invocations:
        callers = [threading.Thread(target=_call, args=(invocations, caller, answers, reporter))
                   for caller in range(CALLERS)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join()
    reporter.close()
    assert len(answers) == CALLERS * REQUESTS_EACH  # each request answered under an id of its own
    logged = read_logged(Storage(StorageLocation(str(log))), "")
    assert logged.without_outcome == 0 and len(logged.request_ids) == len(answers)  # count in = count stored
    for request, observation, action in zip(logged.request_ids, logged.observations, logged.actions, strict=True):
        sent, answered = answers[str(request)]
        np.testing.assert_array_equal(observation, sent)
        assert action == answered
    np.testing.assert_array_equal(logged.rewards, logged.actions.astype(float))
    np.testing.assert_array_equal(logged.next_observations, logged.observations + 1)
    probabilities = np.exp(logged.log_probabilities)
    assert set(np.round(probabilities, 6)) <= {0.9, 0.1}  # epsilon 0.2 of 2 actions: 0.8 + 0.1 or 0.1
    assert set(logged.versions) == {3}
    non_greedy = epsilon_greedy_probabilities(np.zeros(1, int), 0.2, 2)[0, 1]
    assert abs(np.mean(np.isclose(probabilities, non_greedy)) - 0.1) < 0.03  # a tenth of the actions explored away


def _serve_and_log(model_uri: str, tracking_uri: str, log: str, customers: int) -> float:
    """The champion deployed on the offers: epsilon-greedy, every decision and its outcome logged; its
    greedy policy's true share of paying offers."""
    from gymflow.tasks.tracking.models import _global_tracking_uri
    from gymflow.testing.envs import Offers

    kept = signal.getsignal(signal.SIGTERM)  # a model that logs sets the process's SIGTERM handler: put back below
    with _global_tracking_uri(tracking_uri):
        deployed = mlflow.pyfunc.load_model(model_uri, model_config={"decision_log": log, "exploration": "epsilon=0.3"})
        greedy = mlflow.pyfunc.load_model(model_uri)
    signal.signal(signal.SIGTERM, kept)
    env, reporter = Offers(), open_decision_log(log)
    observations = np.stack([env.reset(seed=seed)[0] for seed in range(customers)])
    answer = deployed.predict(observations)
    for request, observation, action in zip(answer["request_ids"], observations, answer["actions"], strict=True):
        env._customer = observation
        reward = env.step(action)[1]
        reporter.observed(Outcome(str(request), reward, observation, True, time.time()))
    reporter.close()
    deployed.unwrap_python_model().recorder.log.close()
    best = np.array([Offers.best_offer(observation) for observation in observations])
    return float(np.mean(greedy.predict(observations) == best))


# default tier: the first retraining with no env played to judge: from a deployed champion's logged decisions
def test_a_retraining_judged_off_policy_promotes_a_better_challenger_and_keeps_the_champion_against_a_worse(
        prefect_api, workspace):
    from gymflow.flows.retrain import retrain
    from tests.conftest import local_overrides

    on_offers = {"env.id": "gymflow.testing.envs:Offers", "agent.hidden_sizes": [32], "schedule.target_return": None,
                 "schedule.heatup_env_steps": 0, "schedule.evaluation_episodes": 20, **local_overrides(workspace)}
    weak = {**on_offers, "schedule.total_env_steps": 64, "schedule.rollout_steps_per_env": 8,
            "schedule.evaluate_every_env_steps": 64, "agent.train_steps_per_iteration": 1}
    first = retrain("cartpole-dqn", weak, model_name="offers", evaluation_episodes=20)
    assert first.promoted  # the first champion, deployed
    log = str(workspace / "decisions")
    champion_accuracy = _serve_and_log(first.challenger.uri, on_offers["tracking.tracking_uri"], log, 4_000)

    steps = workspace / "steps-played"  # every step any process plays of the offers, from here on
    offline = {**on_offers, "schedule.total_train_steps": 1_500, "schedule.evaluate_every_train_steps": 500,
               "env.kwargs": {"steps_file": str(steps)}}
    learned = {"experience": "decisions", "decision_log": log, "judge": "off_policy", "warm_start": False}
    second = retrain("cartpole-dqn", offline, model_name="offers", challenger=learned)
    assert second.champion == first.challenger and second.promoted, second.scores()
    champion, better_by = second.off_policy["champion"]["dr"], second.off_policy["difference"]["dr"]
    assert better_by.low > 0 and abs(champion.value - champion_accuracy) < 0.1, second.scores()  # ~4 std of 600

    untrained = {**offline, "agent.lr": 1e-9}  # its initial weights: a coin's worth of right offers
    third = retrain("cartpole-dqn", untrained, model_name="offers", challenger=learned)
    assert third.champion == second.challenger and not third.promoted, third.scores()
    assert third.off_policy["difference"]["dr"].high < 0, third.scores()  # worse, not merely not better enough
    assert not steps.exists()  # neither challenger's training, evaluations nor judgement played a step
    client = MlflowClient(on_offers["tracking.tracking_uri"])
    evaluated = client.get_metric_history(second.challenger.run_id, "eval/return_mean")
    assert len(evaluated) >= 3 and evaluated[-1].value > 0.8  # each an off-policy estimate (the champion: ~0.4)
    run = client.get_run(third.challenger.run_id)
    assert run.data.tags["gymflow.retrain.outcome"] == "champion kept"
    assert run.data.metrics["retrain/ope_champion_dr"] == pytest.approx(third.champion_return)
    assert {"retrain/ope_challenger_ips_low", "retrain/ope_challenger_snips_ess"} <= set(run.data.metrics)


@pytest.mark.parametrize(("changes", "line"), [
    ({"schedule.evaluate_on": "decisions"}, "schedule.evaluate_on: decisions scores an offline run on its decision log"),
    ({"schedule.evaluate_on": "decisions", "dataset.decisions": "logs", "schedule.total_env_steps": 0,
      "schedule.total_train_steps": 10, "schedule.evaluate_every_train_steps": 5, "schedule.heatup_env_steps": 0},
     "dataset.holdout: must be above 0 with schedule.evaluate_on decisions"),
])
def test_scoring_a_run_on_decisions_needs_an_offline_run_on_a_log_with_decisions_held_out(changes, line):
    from gymflow.errors import InvalidPreset
    from gymflow.presets.validate import resolve_experiment

    with pytest.raises(InvalidPreset) as refused:
        resolve_experiment("cartpole-dqn", changes)
    assert str(refused.value).startswith(line)


def test_a_log_of_episodes_of_no_exploration_or_of_nothing_cannot_judge_in_one_line(tmp_path):
    from gymflow.errors import InvalidPreset
    from gymflow.tasks.lake.decision_log import Decision
    from gymflow.tasks.lake.off_policy import HeldOutChoice, held_out_decisions

    named = ("challenger.decision_log", "challenger.held_out")  # what retrain's refusals name
    from gymflow.tasks.storage.objects import StorageLocation

    def logged(name: str, probability: float, ends_every: int) -> StorageLocation:
        log = open_decision_log(str(tmp_path / name))
        for index in range(50):
            log.decided(Decision(str(index), np.zeros(4, np.float32), index % 2, np.log(probability), "p", 1,
                                 time.time()))
            log.observed(Outcome(str(index), 1.0, np.ones(4, np.float32), index % ends_every == ends_every - 1,
                                 time.time()))
        log.close()
        return StorageLocation(str(tmp_path / name))

    with pytest.raises(InvalidPreset, match=r"^challenger.decision_log: 45 of 50 logged outcomes continue an episode: "
                                            r"judge off_policy weighs one-step decisions; allowed: returns$"):
        held_out_decisions(logged("episodes", 0.5, 10), HeldOutChoice(0.3), 2, named)
    with pytest.raises(InvalidPreset, match=r"^challenger.decision_log: every logged decision was the served policy's "
                                            r"sure choice \(probability 1\): no other choice has support"):
        held_out_decisions(logged("greedy", 1.0, 1), HeldOutChoice(0.3), 2, named)
    with pytest.raises(InvalidPreset, match=r"^challenger.decision_log: no logged decisions under "):
        held_out_decisions(StorageLocation(str(tmp_path / "nothing")), HeldOutChoice(0.3), 2, named)
    assert len(held_out_decisions(logged("bandit", 0.5, 1), HeldOutChoice(0.3), 2, named).logged.actions) > 2


def test_a_live_log_reads_the_same_before_a_cutoff_and_its_held_out_halves_do_not_overlap(tmp_path):
    from gymflow.tasks.lake.decision_log import Decision, held_out
    from gymflow.tasks.storage.objects import Storage, StorageLocation

    log, cutoff = open_decision_log(str(tmp_path)), time.time()
    for index in range(400):
        at = cutoff - 10 if index < 300 else cutoff + 10  # a hundred logged after the run began
        log.decided(Decision(str(index), np.zeros(4, np.float32), 0, np.log(0.5), "p", 1, at))
        log.observed(Outcome(str(index), 1.0, np.zeros(4, np.float32), True, at))
    log.close()
    read = read_logged(Storage(StorageLocation(str(tmp_path))), "", before=cutoff)
    assert sorted(map(int, read.request_ids)) == list(range(300))
    selection, judging, everything = (held_out(read.request_ids, 0.4, part) for part in ("selection", "judging", "all"))
    assert not (selection & judging).any() and ((selection | judging) == everything).all()
    assert 0.3 < everything.mean() < 0.5 and 0.1 < selection.mean() < 0.3
