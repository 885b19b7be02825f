"""Champion/challenger retraining against a real MLflow model registry (SQLite store)."""

from __future__ import annotations

import json
import uuid

import mlflow
import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from gymflow.envs.vector import SeededVectorEnv
from gymflow.errors import InvalidPreset
from gymflow.flows.retrain import retrain
from tests.conftest import local_overrides, prefect_events

pytestmark = pytest.mark.e2e


# default tier (one of its 25 slowest): retraining's champion and challengers, in process
def test_first_run_registers_a_champion_then_better_challengers_win_and_worse_ones_do_not(prefect_api, workspace, tiny_budget):
    weak = {**tiny_budget, "schedule.total_env_steps": 128, "schedule.evaluate_every_env_steps": 10_000, **local_overrides(workspace)}
    first = retrain("cartpole-ppo", weak, model_name="corridor", evaluation_episodes=8)
    assert first.outcome == "first champion registered" and first.promoted
    client = MlflowClient(local_overrides(workspace)["tracking.tracking_uri"])
    assert str(client.get_model_version_by_alias("corridor", "champion").version) == first.challenger.version
    assert client.get_model_version_by_alias("corridor-onnx", "champion").run_id == first.challenger.run_id  # its graph

    longer = {**tiny_budget, "schedule.total_env_steps": 1280, **local_overrides(workspace)}
    second = retrain("cartpole-ppo", longer, model_name="corridor", evaluation_episodes=8)
    assert second.champion == first.challenger
    assert second.promoted == (second.challenger_return > second.champion_return)
    champion_after_second = str(client.get_model_version_by_alias("corridor", "champion").version)
    assert champion_after_second == (second.challenger.version if second.promoted else first.challenger.version)

    # A margin no challenger can clear: the champion is kept, however the challenger scores.
    third = retrain("cartpole-ppo", weak, model_name="corridor", margin=100.0, evaluation_episodes=8)
    assert third.outcome == "champion kept" and not third.promoted
    assert str(client.get_model_version_by_alias("corridor", "champion").version) == champion_after_second
    assert client.get_model_version_by_alias("corridor-onnx", "champion").run_id == \
        client.get_model_version_by_alias("corridor", "champion").run_id  # the kept champion's graph, kept with it
    # Both policies were scored on the same seeds, and the decision is on the challenger's run.
    run = client.get_run(third.challenger.run_id)
    assert run.data.tags["gymflow.retrain.outcome"] == "champion kept"
    assert run.data.tags["gymflow.retrain.episode_seeds"] == ",".join(map(str, third.episode_seeds))
    assert run.data.metrics["retrain/champion_return"] == pytest.approx(third.champion_return)
    assert len(client.search_model_versions("name='corridor'")) == 3
    events = prefect_events("gymflow.model.corridor", ["gymflow.model.promoted", "gymflow.model.kept"], at_least=3)
    decided = [(event.event, event.payload["challenger_version"]) for event in events]
    assert decided == [(f"gymflow.model.{'promoted' if d.promoted else 'kept'}", d.challenger.version)
                       for d in (first, second, third)]
    assert events[-1].payload["champion_return"] == pytest.approx(third.champion_return)
    assert events[-1].payload["challenger_return"] == pytest.approx(third.challenger_return)


def test_a_degraded_champion_s_events_hand_on_its_overrides_without_credentials(prefect_api, workspace, tiny_budget):
    """A monitoring run's overrides become a retraining's parameters through its events (prefect.yaml's
    automation): credentials in them are left out, so Prefect stores none of them."""
    from gymflow.flows.monitor import monitor

    weak = {**tiny_budget, "schedule.total_env_steps": 128, "schedule.evaluate_every_env_steps": 10_000,
            **local_overrides(workspace)}
    retrain("cartpole-ppo", weak, model_name="watched", evaluation_episodes=2)
    planted = f"planted-{uuid.uuid4().hex}"
    score = monitor("cartpole-ppo", {**weak, "storage.options": {"secret": planted, "client_kwargs": {
        "aws_session_token": planted, "region_name": "eu-west-1"}}}, model_name="watched", threshold=1e9,
        evaluation_episodes=2)
    assert score.degraded
    events = prefect_events("gymflow.model.watched", ["gymflow.model.scored", "gymflow.model.degraded"])
    scored = [event for event in events if event.event in ("gymflow.model.scored", "gymflow.model.degraded")]
    assert len(scored) == 2
    for event in scored:
        assert planted not in json.dumps(event.payload)
        assert event.payload["overrides"] == {**weak, "storage.options": {"client_kwargs": {"region_name": "eu-west-1"}}}


@pytest.mark.slow  # long tier: test_first_run_registers_a_champion... also holds a worse challenger back
def test_a_worse_challenger_is_not_promoted(prefect_api, workspace):
    on_cartpole = {"schedule.target_return": None, "schedule.evaluate_every_env_steps": 100_000, **local_overrides(workspace)}
    first = retrain("cartpole-ppo", {**on_cartpole, "schedule.total_env_steps": 8192}, model_name="keep", evaluation_episodes=8)
    # a challenger from scratch on one tiny round: far from balancing the pole
    untrained = {**on_cartpole, "schedule.total_env_steps": 128, "schedule.rollout_steps_per_env": 8}
    second = retrain("cartpole-ppo", untrained, model_name="keep", evaluation_episodes=8, challenger={"warm_start": False})
    assert second.challenger_return < second.champion_return
    assert not second.promoted and second.outcome == "champion kept"
    assert MlflowClient(local_overrides(workspace)["tracking.tracking_uri"]).get_model_version_by_alias(
        "keep", "champion").version == int(first.challenger.version)


def test_the_logged_policy_loads_as_an_mlflow_model_and_runs_on_a_gymnasium_env(prefect_api, workspace, tiny_budget):
    decision = retrain("cartpole-ppo", {**tiny_budget, "schedule.total_env_steps": 1280, **local_overrides(workspace)},
                       model_name="docs-example", evaluation_episodes=4)
    mlflow.set_tracking_uri(local_overrides(workspace)["tracking.tracking_uri"])
    policy = mlflow.pyfunc.load_model("models:/docs-example@champion")
    env = SeededVectorEnv("gymflow.testing.envs:Corridor", {}, num_envs=4, seed=7)
    obs = env.reset()
    actions = policy.predict(obs)
    assert actions.shape == (4,) and set(np.unique(actions)) <= {0, 1}
    assert decision.promoted


@pytest.mark.slow  # long tier: self-play learning stays in (tests/test_multi_agent.py), promotion by returns here
def test_a_self_play_league_promotes_a_challenger_only_when_it_wins_its_match(prefect_api, workspace):
    run = {**local_overrides(workspace), "distribution.mode": "single", "tracking.video": "off"}
    # a champion that has hardly trained: one round of 512 env steps
    first = retrain("race-ppo", {**run, "schedule.total_env_steps": 512}, model_name="league",
                    evaluation_episodes=60, challenger={"warm_start": False, "judge": "match"})
    assert first.outcome == "first champion registered" and first.match is None
    second = retrain("race-ppo", run, model_name="league", evaluation_episodes=60, challenger={"judge": "match"})
    assert second.match is not None and second.match.games == 60
    assert second.promoted == (second.match.interval()[0] > 0.5)
    assert second.promoted, second.scores()  # 20,000 env steps of self-play beat one round of them
    client = MlflowClient(local_overrides(workspace)["tracking.tracking_uri"])
    assert str(client.get_model_version_by_alias("league", "champion").version) == second.challenger.version
    version = client.get_model_version("league", second.challenger.version)
    assert version.tags["gymflow.match"].startswith("challenger promoted against v1: the challenger won")
    metrics = client.get_run(second.challenger.run_id).data.metrics
    assert metrics["retrain/match_wins"] == second.match.wins
    # a challenger no better than the champion (the same training, a margin no score clears) is not promoted
    third = retrain("race-ppo", run, model_name="league", evaluation_episodes=60, margin=0.5,
                    challenger={"judge": "match"})
    assert not third.promoted and third.outcome == "champion kept"


def test_a_match_is_judged_only_between_two_players_in_one_line(prefect_api, workspace):
    with pytest.raises(InvalidPreset, match=r"^challenger.judge: match is for two-player PettingZoo envs; 'CartPole-v1' is not "
                                            r"one: allowed: returns$"):
        retrain("cartpole-ppo", local_overrides(workspace), challenger={"judge": "match"})


def test_a_champion_without_an_onnx_graph_takes_the_graphs_champion_alias_away(tmp_path):
    """A promoted challenger that logged no graph (a policy that cannot be one): `<name>-onnx@champion`
    would name the champion before it, so it names nothing."""
    from gymflow.tasks.tracking.models import ModelRef, promote

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    for name in ("corridor", "corridor-onnx"):
        client.create_registered_model(name)
        for _ in range(2):
            client.create_model_version(name, str(tmp_path / "model"), run_id=None)
    promote.fn(uri, ModelRef("corridor", "1", "first"), ModelRef("corridor-onnx", "1", "first"))
    assert str(client.get_model_version_by_alias("corridor-onnx", "champion").version) == "1"
    promote.fn(uri, ModelRef("corridor", "2", "second"), None)
    assert str(client.get_model_version_by_alias("corridor", "champion").version) == "2"
    assert "champion" not in client.get_registered_model("corridor-onnx").aliases
