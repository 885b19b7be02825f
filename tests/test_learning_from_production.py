"""Learning from what a deployed policy did: a policy served by `mlflow models serve` as a deployment
that explores and logs every decision answers thousands of concurrent requests, each under a
request id its caller reports the outcome under; every decision and outcome is stored, joined, and
carries the probability the served policy acted with."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import requests

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
