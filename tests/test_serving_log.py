"""A served policy's exploration and decision log (agents/exploration.py, tasks/lake/serving_log.py):
the probabilities it logs are those it acts with, a deployment's bad setting is one line before any
request, and a store that is behind costs the callers neither time nor errors."""

from __future__ import annotations

import math
import signal
import time
import uuid

import mlflow
import numpy as np
import pytest
import torch

from gymflow.agents.exploration import Exploration, epsilon_greedy_probabilities, explored
from gymflow.errors import GymflowError
from gymflow.tasks.lake.decision_log import Decision, DecisionLog
from gymflow.tasks.lake.serving_log import serving_settings
from gymflow.tasks.storage.codec import decode_arrays
from gymflow.tasks.storage.objects import Storage, StorageLocation
from gymflow.tasks.tracking.models import save_policy_model
from gymflow.testing.policies import untrained_policy_model


def test_epsilon_greedy_acts_and_logs_the_probabilities_it_acts_with():
    greedy = np.array([2] * 40_000)
    acted = explored(greedy, Exploration("epsilon", 0.3), np.random.default_rng(0), actions_n=4)
    share = np.bincount(acted.actions, minlength=4) / len(greedy)
    np.testing.assert_allclose(share, [0.075, 0.075, 0.775, 0.075], atol=0.01)
    expected = epsilon_greedy_probabilities(greedy, 0.3, 4)[np.arange(len(greedy)), acted.actions]
    np.testing.assert_allclose(np.exp(acted.log_probabilities), expected)
    assert np.all(explored(greedy[:5], Exploration(), np.random.default_rng(0), 4).log_probabilities == 0)


def test_gaussian_noise_logs_the_samples_density_and_sends_it_clipped_to_the_bounds():
    low, high = np.array([-1.0, -2.0], np.float32), np.array([1.0, 2.0], np.float32)
    greedy = np.array([[0.9, 0.0], [0.0, -1.9]], np.float32)
    acted = explored(greedy, Exploration("noise", 0.5), np.random.default_rng(1), bounds=(low, high))
    sigma = torch.tensor([0.5, 1.0])
    expected = torch.distributions.Normal(torch.from_numpy(greedy), sigma).log_prob(
        torch.from_numpy(acted.logged)).sum(dim=1)
    np.testing.assert_allclose(acted.log_probabilities, expected.numpy(), rtol=1e-5)
    np.testing.assert_array_equal(acted.actions, np.clip(acted.logged, low, high))


@pytest.mark.parametrize(("config", "line"), [
    ({"exploration": "epsilon=2"}, "model_config['exploration']: 'epsilon=2' is not an exploration; allowed: "
                                   "greedy, epsilon=E (0 < E <= 1), noise=S (S > 0)"),
    ({"exploration": "boltzmann"}, "model_config['exploration']: 'boltzmann' is not an exploration"),
    ({"decision_flush_s": "soon"}, "model_config['decision_flush_s']: 'soon' is not a number above 0"),
])
def test_a_deployments_bad_setting_is_one_line_naming_it(config, line):
    with pytest.raises(GymflowError) as refused:
        serving_settings(config)
    assert str(refused.value).startswith(line)


def test_the_environment_sets_what_the_model_config_leaves_empty(monkeypatch):
    monkeypatch.setenv("GYMFLOW_EXPLORATION", "noise=0.2")
    monkeypatch.setenv("GYMFLOW_DECISION_LOG", "s3://bucket/serving")
    settings = serving_settings({"exploration": "", "decision_log": "", "decision_flush_s": ""})
    assert (settings.exploration, settings.decision_log) == (Exploration("noise", 0.2), "s3://bucket/serving")
    monkeypatch.setenv("GYMFLOW_EXPLORATION", "epsilon=-1")
    with pytest.raises(GymflowError, match=r"^GYMFLOW_EXPLORATION: 'epsilon=-1' is not an exploration"):
        serving_settings({"exploration": ""})


@pytest.fixture
def sigterm_kept():
    """A model that logs decisions sets the process's SIGTERM handler (tasks/lake/serving_log.py): put back."""
    kept = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, kept)


def test_a_served_model_logs_each_decision_it_answers_under_the_request_id_it_returns(tmp_path, sigterm_kept):
    save_policy_model(untrained_policy_model("cartpole-ppo", version=4), str(tmp_path / "model"))
    model = mlflow.pyfunc.load_model(str(tmp_path / "model"), model_config={
        "decision_log": str(tmp_path / "log"), "exploration": "epsilon=0.5", "decision_flush_s": 0.05})
    observations = np.random.default_rng(0).normal(size=(300, 4)).astype(np.float32)
    answer = model.predict(observations)
    greedy = mlflow.pyfunc.load_model(str(tmp_path / "model")).predict(observations)
    storage = Storage(StorageLocation(str(tmp_path / "log")))
    deadline = time.monotonic() + 30
    while not storage.list("decisions"):
        assert time.monotonic() < deadline, "the log's thread wrote nothing in 30 s"
        time.sleep(0.05)
    model.unwrap_python_model().recorder.log.close()  # what its thread had not written yet, and its thread
    shards = [decode_arrays(storage.read(key)) for key in sorted(storage.list("decisions"))]
    logged = {name: np.concatenate([shard[name] for shard in shards]) for name in shards[0]}
    np.testing.assert_array_equal(logged["request_id"], answer["request_ids"])
    np.testing.assert_array_equal(logged["action"], answer["actions"])
    np.testing.assert_array_equal(logged["observation"], observations)
    expected = epsilon_greedy_probabilities(greedy, 0.5, 2)[np.arange(300), answer["actions"]]
    np.testing.assert_allclose(np.exp(logged["log_probability"]), expected)
    assert set(logged["policy"]) == {"cartpole-ppo-v4"} and set(logged["version"]) == {4}
    assert 0.15 < np.mean(answer["actions"] != greedy) < 0.35  # epsilon 0.5 of 2 actions: a quarter differ


def test_a_continuous_policy_logs_only_with_noise_and_a_discrete_one_takes_no_noise(tmp_path):
    save_policy_model(untrained_policy_model("pendulum-sac"), str(tmp_path / "sac"))
    with pytest.raises(GymflowError, match=r"^GYMFLOW_EXPLORATION: a continuous policy's decisions are logged with "
                                           r"noise=S exploration"):
        mlflow.pyfunc.load_model(str(tmp_path / "sac"), model_config={"decision_log": str(tmp_path / "log")})
    save_policy_model(untrained_policy_model("cartpole-dqn"), str(tmp_path / "dqn"))
    with pytest.raises(GymflowError, match=r"^model_config\['exploration'\]: noise=S is for continuous actions"):
        mlflow.pyfunc.load_model(str(tmp_path / "dqn"), model_config={"exploration": "noise=0.1"})
    assert not (tmp_path / "log").exists()


def test_a_store_that_is_behind_neither_holds_up_nor_fails_the_callers_and_keeps_memory_bounded(tmp_path):
    class Stalled(Storage):
        def write(self, key: str, data: bytes) -> None:
            time.sleep(0.5)
            raise OSError("the store did not answer")

    log = DecisionLog(Stalled(StorageLocation(str(tmp_path))), "serving", shard_records=10, most_waiting=500)
    log.start(every_s=0.01)
    started = time.perf_counter()
    for index in range(2_000):
        log.decided(Decision(str(index), np.zeros(3, np.float32), 0, math.log(0.5), "p", 1, time.time()))
    assert time.perf_counter() - started < 1.0  # no call waited for the store
    log.close()
    assert log.written["decisions"] == 0
    assert log.dropped["decisions"] == 2_000  # those past the bound at once, the rest with a shard that failed


def test_closing_the_log_writes_what_its_thread_had_not_yet(tmp_path):
    storage = Storage(StorageLocation(str(tmp_path)))
    log = DecisionLog(storage, "serving", shard_records=1_000)
    log.start(every_s=3600)
    for index in range(150):
        log.decided(Decision(str(index), np.zeros(3, np.float32), 1, 0.0, "p", 1, time.time()))
    log.close()
    assert log.written["decisions"] == 150
    assert len(storage.list("serving/decisions")) == 1


def test_a_serving_log_with_a_retention_deletes_the_shards_older_than_it_and_keeps_the_rest(tmp_path):
    storage = Storage(StorageLocation(str(tmp_path)))
    now, day = time.time(), 86_400
    for age_days, kind in ((100, "decisions"), (95, "outcomes"), (10, "decisions"), (1, "outcomes")):
        storage.write(f"serving/{kind}/{now - age_days * day:.6f}-{uuid.uuid4().hex}-0123456789abcdef.npz", b"x")
    settings = serving_settings({"decision_log": str(tmp_path / "serving"), "decision_retention_days": "90"})
    assert settings.retention_s == 90 * day
    log = DecisionLog(storage, "serving")
    log.start(every_s=0.01, retention_s=settings.retention_s)
    deadline = time.monotonic() + 10
    while log.pruned < 2:
        assert time.monotonic() < deadline, "the log's thread pruned nothing in 10 s"
        time.sleep(0.01)
    log.close()
    ages = sorted(round((now - float(key.rsplit("/", 1)[-1].split("-")[0])) / day) for key in storage.list("serving"))
    assert ages == [1, 10] and log.pruned == 2
