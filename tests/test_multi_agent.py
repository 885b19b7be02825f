"""PettingZoo parallel envs: every agent of every game a row of the vector env, one shared policy
(IPPO), agents that leave mid-episode, and runs under the real Prefect API and Dask workers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gymnasium import spaces
from mlflow.tracking import MlflowClient

from gymflow.agents.configs import PPOConfig
from gymflow.agents.match import MatchResult, Sides, first_rows, play_match
from gymflow.agents.ppo import PPOLearner, PPOPolicy, make_network
from gymflow.agents.rollout import RandomPolicy, collect
from gymflow.envs.agents import SeededAgentVectorEnv
from gymflow.envs.make import Preprocessing, env_spaces
from gymflow.envs.vector import make_vector_env
from gymflow.flows.improve import improve
from gymflow.presets import InvalidPreset
from gymflow.presets.load import load_preset
from gymflow.presets.model import OpponentPool
from gymflow.presets.validate import resolve_experiment
from gymflow.tasks.cluster.rounds import RoundPlan
from gymflow.tasks.lake.export import ExportRefused, find_group_experience, find_run_experience
from gymflow.tasks.storage.checkpoints import POLICY_BLOB, read_policy
from gymflow.tasks.storage.codec import decode_tensors
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage, StorageLocation
from tests.conftest import local_overrides

EXITS = "pettingzoo:gymflow.testing.agents:Exits"
SPREAD = "pettingzoo:mpe2.simple_spread_v3"


class Right:
    """Every agent steps right: each walker reaches its exit in a few steps."""

    def act(self, obs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        return np.ones(len(obs), dtype=np.int64), np.zeros(len(obs), dtype=np.float32)


def test_a_game_of_k_agents_is_k_rows_each_padded_and_told_its_index():
    env = SeededAgentVectorEnv(EXITS, {"walkers": 2}, num_games=2, seed=3)
    obs = env.reset()
    assert env.num_envs == 6 and env.table.groups == ("walker", "walker", "guide")
    assert env.observation_space.shape == (3 + 3,)  # the longest observation (the guide's 3), then a one-hot of 3
    np.testing.assert_array_equal(obs[:, 3:], np.tile(np.eye(3, dtype=np.float32), (2, 1)))
    assert (obs[[0, 1, 3, 4], 2] == 0).all()  # a walker observes 2 entries: the third is padding
    np.testing.assert_array_equal(env.agents, [0, 1, 2, 0, 1, 2])


def test_an_agent_that_leaves_ends_its_row_which_idles_until_its_game_starts_again():
    env = SeededAgentVectorEnv(EXITS, {"walkers": 2, "length": 6}, num_games=1, seed=3)
    env.reset()
    rollout, episodes = collect(Right(), env, 8)
    walkers_done = [int(np.argmax(rollout.terminated[:, row])) for row in (0, 1)]
    assert walkers_done[0] != walkers_done[1]  # seeded starts: they arrive at different steps
    first, last = min(walkers_done), max(walkers_done)
    early = int(np.argmin(walkers_done))
    assert rollout.alive[: first + 1, early].all() and not rollout.alive[first + 1 : last + 1, early].any()
    assert (rollout.rewards[first + 1 : last + 1, early] == 0).all()
    assert rollout.rewards[first, early] == 1.0
    # the last walker out ends the game (the guide's episode with it); every row is alive in the next
    assert rollout.terminated[last, 2] and rollout.alive[last + 1].all()
    assert sorted(episodes.lengths[:3]) == [first + 1, last + 1, last + 1]  # each agent's episode: its life
    assert rollout.env_steps == 8  # one game: 8 joint steps (of 3 rows each)
    next_obs = rollout.next_obs()
    assert next_obs[first, early, 0] == 1.0  # the leaver's own last observation, at its exit


@pytest.mark.parametrize(("env_id", "kwargs"), [(EXITS, {"walkers": 3}), (SPREAD, {"max_cycles": 10})])
def test_a_cursor_rebuilds_games_exactly_mid_episode_with_agents_gone(env_id, kwargs):
    env = make_vector_env(env_id, kwargs, 3, seed=11)
    env.reset()
    collect(RandomPolicy(env.action_space, 0), env, 13)
    rebuilt = make_vector_env(env_id, kwargs, 3, seed=11)
    rebuilt.reset(env.cursor())
    np.testing.assert_array_equal(rebuilt.obs, env.obs)
    np.testing.assert_array_equal(rebuilt.alive, env.alive)
    going_on, _ = collect(RandomPolicy(env.action_space, 5), env, 20)
    replayed, _ = collect(RandomPolicy(env.action_space, 5), rebuilt, 20)
    for name, value in going_on._asdict().items():
        if value is not None:
            np.testing.assert_array_equal(value, getattr(replayed, name), err_msg=name)


def test_ppo_learns_from_live_agents_steps_alone():
    env = SeededAgentVectorEnv(EXITS, {"walkers": 2}, num_games=2, seed=1)
    env.reset()
    rollout, _ = collect(Right(), env, 12)
    assert not rollout.alive.all()
    learner = PPOLearner(PPOConfig(hidden_sizes=[8]), env.observation_space, env.action_space, seed=0)
    batch = learner._flatten([rollout])
    assert len(batch["obs"]) == int(rollout.alive.sum())
    live = torch.from_numpy(rollout.obs[rollout.alive])
    torch.testing.assert_close(batch["obs"], live)


def test_agents_that_cannot_share_a_policy_or_an_algorithm_that_cannot_learn_them_are_refused_in_one_line():
    with pytest.raises(InvalidPreset, match=r"^agent.algo: 'pettingzoo:.*' is a PettingZoo env: its agents learn "
                                            r"with ppo .*; allowed: ppo$"):
        resolve_experiment("cartpole-dqn", {"env.id": EXITS})
    with pytest.raises(InvalidPreset, match=r"^env.id: cannot import 'no_such_module' .*pip install "
                                            r"'gymflow\[multiagent\]'$"):
        resolve_experiment("spread-ippo", {"env.id": "pettingzoo:no_such_module"})
    with pytest.raises(InvalidPreset, match=r"^env.kwargs: .* refused its kwargs"):
        resolve_experiment("spread-ippo", {"env.kwargs": {"wings": 2}})
    with pytest.raises(InvalidPreset, match=r"^env.id: .* frame stacks, Atari's preprocessing and hidden entries"):
        resolve_experiment("spread-ippo", {"env.hide": [0]})


def test_agents_of_other_action_spaces_cannot_share_one_policy():
    with pytest.raises(InvalidPreset, match=r"^env.id: 'pettingzoo:mpe2.simple_world_comm_v3': agent 'adversary_0' "
                                            r"acts in Discrete\(5\), 'leadadversary_0' in Discrete\(20\); allowed: one"):
        resolve_experiment("spread-ippo", {"env.id": "pettingzoo:mpe2.simple_world_comm_v3", "env.kwargs": {}})


TINY_SPREAD = {"env.kwargs": {"max_cycles": 10}, "agent.minibatch_size": 64, "agent.hidden_sizes": [16]}


# default tier (one of its 25 slowest): many agents end to end (MAPPO; single mode as SYNC)
@pytest.mark.e2e
# long tier: spread-ippo (24 s); IPPO trains end to end in tests/test_lake.py's export of its groups
@pytest.mark.parametrize("preset", [pytest.param("spread-ippo", marks=pytest.mark.slow), "spread-mappo"])
def test_a_pettingzoo_env_trains_end_to_end_and_single_ends_as_sync_does(prefect_api, workspace, tiny_budget, preset):
    run = {**tiny_budget, **local_overrides(workspace), **TINY_SPREAD, "env.id": SPREAD}
    synced = improve(preset, {**run, "storage.root": str(workspace / "sync")})
    assert synced.env_steps == 640 and synced.versions_committed == 6  # joint steps: 2 workers x 4 games x 16 x 5
    assert np.isfinite(synced.final_return) and len(synced.rollout_processes) == 2  # two Dask workers
    metrics = MlflowClient(run["tracking.tracking_uri"]).get_run(synced.mlflow_run_id).data.metrics
    assert metrics["eval/agent/return_mean"] == pytest.approx(metrics["eval/return_mean"])  # one group: 'agent'
    videos = list((workspace / "sync" / "runs" / synced.run_id / "videos").glob("*.mp4"))
    assert videos and videos[0].stat().st_size > 1000  # game 0 of the final evaluation, every agent acting
    with pytest.raises(ExportRefused, match=r"is of a PettingZoo env .* `gymflow export RUN_ID --group NAME` writes one group's episodes"):
        find_run_experience(Storage(StorageLocation(str(workspace / "sync"))), synced.run_id)
    _export_reads_each_agent_s_own_observations(Storage(StorageLocation(str(workspace / "sync"))), synced.run_id)
    single = improve(preset, {**run, "storage.root": str(workspace / "single"), "distribution.mode": "single"})
    assert _final_policy(workspace / "single", single) == _final_policy(workspace / "sync", synced)


def _export_reads_each_agent_s_own_observations(storage: Storage, run_id: str) -> None:
    """An export of the run's one group ('agent') reads each agent's lives, its own 18 entries
    observed (no agent index, no game state), of at most the game's 10 steps."""
    experience = find_group_experience(storage, run_id, None)
    assert experience.group.name == "agent" and experience.observation_space.shape == (18,)
    episodes = [episode for stitcher in experience.stitchers() for episode in stitcher.read(storage)]
    assert episodes and {episode.agent for episode in episodes} == {0, 1, 2}
    for episode in episodes:
        assert episode.observations.shape == (episode.steps + 1, 18) and episode.steps <= 10


def _final_policy(root, summary) -> bytes:
    return read_policy(Storage(StorageLocation(str(root))), RunLayout(summary.run_id),
                       summary.versions_committed - 1, [POLICY_BLOB])[POLICY_BLOB]


def test_mappo_rows_carry_the_game_state_which_the_critic_reads_and_the_actor_does_not():
    env = make_vector_env(SPREAD, {"max_cycles": 10}, 2, seed=4, preprocessing=Preprocessing(global_state=True))
    obs = env.reset()
    actor_part = env.observation_space.actor_entries
    assert actor_part == 18 + 3 and obs.shape == (6, actor_part + 54)  # mpe2's state: the 3 agents' observations
    np.testing.assert_array_equal(obs[0, actor_part:], obs[1, actor_part:])  # one game, one state
    network = make_network(PPOConfig(hidden_sizes=[16]), env.observation_space, env.action_space)
    other_state = torch.from_numpy(obs.copy())
    other_state[:, actor_part:] += 1.0
    with torch.no_grad():
        torch.testing.assert_close(network.action_output(torch.from_numpy(obs)), network.action_output(other_state))
        assert not torch.allclose(network.value(torch.from_numpy(obs)), network.value(other_state))


def test_a_global_state_is_refused_where_there_is_none_in_one_line():
    with pytest.raises(InvalidPreset, match=r"^env.global_state: is a PettingZoo env's state .* allowed: false$"):
        resolve_experiment("cartpole-ppo", {"env.global_state": True})
    with pytest.raises(InvalidPreset, match=r"^env.global_state: .*Exits' has no 1-D Box state_space .* allowed: false$"):
        resolve_experiment("spread-mappo", {"env.id": EXITS, "env.kwargs": {}})


def test_an_evaluation_scores_each_agent_group_apart():
    from gymflow.tasks.cluster.messages import EvaluationResult
    from gymflow.tasks.training.evaluation import Scored

    env = SeededAgentVectorEnv(EXITS, {"walkers": 2}, num_games=2, seed=0)
    groups = tuple(env.table.groups[agent] for agent in env.agents)
    result = EvaluationResult(3, (1.0, 0.5, 2.0, 1.5, 1.0, 4.0), (5,) * 6, 0.1, groups=groups)
    metrics = Scored(100, result).metrics()
    assert metrics["eval/walker/return_mean"] == pytest.approx(1.0) and metrics["eval/guide/return_mean"] == 3.0


ADVERSARY = "pettingzoo:mpe2.simple_adversary_v3"  # groups 'adversary' (observes 8) and 'agent' (observes 10)


@pytest.mark.parametrize("continuous", [False, True])
def test_separate_policies_act_on_their_groups_rows_with_the_log_probabilities_they_learn_with(continuous):
    env = make_vector_env(ADVERSARY, {"max_cycles": 10, "continuous_actions": continuous}, 2, seed=2)
    obs = env.reset()
    config = PPOConfig(hidden_sizes=[16], log_std_init=-0.5, policies={"adversary": "adversaries"})
    network = make_network(config, env.observation_space, env.action_space)
    assert list(network.policies) == ["adversaries", "shared"]  # the agents' group is not named: 'shared'
    batch = torch.from_numpy(obs)
    with torch.no_grad():
        for name, rows in (("adversaries", [0, 3]), ("shared", [1, 2, 4, 5])):  # agent 0 of each game: the adversary
            torch.testing.assert_close(network.action_output(batch)[rows], network.policies[name].action_output(batch[rows]))
            torch.testing.assert_close(network.value(batch)[rows], network.policies[name].value(batch[rows]))
    actions, acting = PPOPolicy(network, seed=1).act(obs, explore=True)
    with torch.no_grad():
        distribution, _ = network.distribution_and_value(batch)
        learning = distribution.log_prob(torch.from_numpy(actions)).numpy()
    np.testing.assert_allclose(acting, learning, rtol=1e-5, atol=1e-5)


def test_a_ppo_update_steps_each_group_s_policy_on_its_own_rows():
    env = SeededAgentVectorEnv(EXITS, {"walkers": 2}, num_games=2, seed=1)
    env.reset()
    config = PPOConfig(hidden_sizes=[8], minibatch_size=32, policies={"guide": "guides", "walker": "walkers"})
    learner = PPOLearner(config, env.observation_space, env.action_space, seed=0)
    before = {name: [p.detach().clone() for p in network.parameters()]
              for name, network in learner.network.policies.items()}
    rollout, _ = collect(PPOPolicy(learner.network, 0), env, 16)
    learner.learn([rollout], 0.0)
    for name, network in learner.network.policies.items():
        assert any(not torch.equal(old, new) for old, new in zip(before[name], network.parameters())), name
    walkers = learner.network.policies["walkers"]
    guide_rows = torch.from_numpy(rollout.obs[:, [2, 5]].reshape(-1, env.observation_space.shape[0]))
    with torch.no_grad():  # what the guides' policy says of its rows is its own, not the walkers'
        assert not torch.allclose(learner.network.value(guide_rows), walkers.value(guide_rows))


def test_a_policy_mapping_names_groups_the_env_has_in_one_line():
    with pytest.raises(InvalidPreset, match=r"^agent.policies: 'pettingzoo:mpe2.simple_spread_v3' has no agent group "
                                            r"'adversary'; its groups: agent$"):
        resolve_experiment("spread-ippo", {"agent.policies": {"adversary": "adversaries"}})
    with pytest.raises(InvalidPreset, match=r"^agent.policies: maps a PettingZoo env's agent groups .* allowed: \{\}$"):
        resolve_experiment("cartpole-ppo", {"agent.policies": {"agent": "a"}})


RACE = "pettingzoo:gymflow.envs.race"


def _races(games: int, seed: int) -> SeededAgentVectorEnv:
    return SeededAgentVectorEnv(RACE, {}, games, seed)


class Run:
    """Race's best reply to anything: run every step."""

    def act(self, obs: np.ndarray, explore: bool) -> tuple[np.ndarray, np.ndarray]:
        return np.ones(len(obs), dtype=np.int64), np.zeros(len(obs), dtype=np.float32)


def test_a_match_scores_the_first_policy_with_sides_swapped_and_an_interval():
    random_runner = RandomPolicy(spaces.Discrete(3), seed=0)
    strong = play_match(Run(), random_runner, _races(100, seed=1))
    assert strong.games == 100 and strong.interval()[0] > 0.75
    even = play_match(RandomPolicy(spaces.Discrete(3), 1), RandomPolicy(spaces.Discrete(3), 2), _races(200, seed=1))
    low, high = even.interval()
    assert low < 0.5 < high and high - low < 0.15
    assert play_match(Run(), Run(), _races(10, seed=1)) == MatchResult(0, 10, 0)  # the same runner: all draws
    with pytest.raises(ValueError, match="3 agents a game; a match is between two"):
        play_match(Run(), Run(), SeededAgentVectorEnv(EXITS, {}, 2, seed=0))


@pytest.mark.e2e
def test_a_policy_trained_by_self_play_beats_a_random_one(prefect_api, workspace):
    summary = improve("race-ppo", {**local_overrides(workspace), "distribution.mode": "single",
                                   "tracking.video": "off"})
    assert summary.final_return > 0.75  # its evaluations: its score per game against a random runner
    preset = load_preset("race-ppo")
    observation_space, action_space = env_spaces(RACE, {})
    network = make_network(preset.agent, observation_space, action_space)
    network.load_state_dict(decode_tensors(_final_policy(workspace / "data", summary)))
    against_random = play_match(PPOPolicy(network, 0), RandomPolicy(action_space, 3), _races(100, seed=7))
    assert against_random.interval()[0] > 0.75, against_random
    # it has learnt when to sprint (where its footing is good): it beats a runner that always runs
    against_runner = play_match(PPOPolicy(network, 0), Run(), _races(200, seed=7))
    assert against_runner.interval()[0] > 0.6, against_runner


def test_a_pool_holds_the_newest_snapshots_older_than_the_acting_version():
    pool = OpponentPool(size=3, every=5)
    assert [pool.members(v) for v in (0, 1, 5, 6, 16, 21)] == [[], [0], [0], [0, 5], [5, 10, 15], [10, 15, 20]]


def test_each_job_s_opponent_is_drawn_from_the_pool_by_the_seed():
    preset = load_preset("race-ppo", {"schedule.opponent_pool": {"size": 5, "every": 4, "share": 0.5}})
    pool = preset.schedule.opponent_pool
    plan = RoundPlan(preset, "run-1")
    faced = [(version, plan.opponent(version, worker)) for version in range(1, 200) for worker in range(2)]
    assert all(opponent is None or opponent in pool.members(version) for version, opponent in faced)
    past = [opponent for _, opponent in faced if opponent is not None]
    assert 0.4 < len(past) / len(faced) < 0.6  # its share: 0.5
    assert len(set(past)) > pool.size  # the pool moves on with the versions
    assert [spec.opponent_version for spec in plan.rollouts(40, 0.0, [None, None])] == [plan.opponent(40, 0),
                                                                                       plan.opponent(40, 1)]
    assert plan.opponent(None, 0) is None and plan.opponent(0, 0) is None  # heatup; no snapshot before v0
    alone = RoundPlan(load_preset("race-ppo"), "run-1")  # as it ships: the current policy plays both sides
    assert {alone.opponent(version, 0) for version in range(50)} == {None}


def test_a_policy_facing_a_past_version_plays_one_side_and_learns_from_that_side_alone():
    env = _races(6, seed=2)
    env.reset()
    config = load_preset("race-ppo").agent
    network = make_network(config, env.observation_space, env.action_space)
    firsts = first_rows(env.num_envs)
    learning = np.zeros(env.num_envs, dtype=bool)
    learning[firsts] = True
    both = Sides(PPOPolicy(network, seed=1), Run(), firsts)
    rollout, episodes = collect(both, env, 64, learning=learning)
    assert not rollout.alive[:, ~learning].any() and rollout.alive[:, learning].any()
    assert (rollout.actions[:, ~learning] == 1).all()  # the opponent's rows: its actions
    ended_rows = rollout.done_index % env.num_envs
    assert len(episodes.returns) == learning[ended_rows].sum() < len(ended_rows)  # the opponent's are not counted
    # the learning rows' log-probabilities are the acting policy's
    obs, actions = torch.as_tensor(rollout.obs[:, firsts]), torch.as_tensor(rollout.actions[:, firsts])
    with torch.no_grad():
        expected = network.distribution_and_value(obs.flatten(0, 1))[0].log_prob(actions.flatten())
    np.testing.assert_allclose(rollout.log_probs[:, firsts].flatten(), expected.numpy(), atol=1e-5)


def test_a_pool_of_past_versions_is_for_two_player_games_of_one_shared_policy():
    pool = {"schedule.opponent_pool": {"size": 2}}
    with pytest.raises(InvalidPreset, match=r"^schedule.opponent_pool: is for two-player games; "
                                            r"'pettingzoo:mpe2.simple_spread_v3' has 3 agents: allowed: null$"):
        resolve_experiment("spread-ippo", pool)
    with pytest.raises(InvalidPreset, match=r"^schedule.opponent_pool: is for two-player PettingZoo games"):
        resolve_experiment("cartpole-ppo", pool)
    with pytest.raises(InvalidPreset, match=r"^schedule.opponent_pool: plays past versions of the one policy"):
        resolve_experiment("race-ppo", {**pool, "agent.policies": {"runner": "runners"}})


def test_an_evaluation_against_a_random_player_is_for_two_player_games_only():
    with pytest.raises(InvalidPreset, match=r"^schedule.evaluation_opponent: random is for two-player games; "
                                            r"'pettingzoo:mpe2.simple_spread_v3' has 3 agents: allowed: itself$"):
        resolve_experiment("spread-ippo", {"schedule.evaluation_opponent": "random"})
    with pytest.raises(InvalidPreset, match=r"^schedule.evaluation_opponent: is for two-player PettingZoo games"):
        resolve_experiment("cartpole-ppo", {"schedule.evaluation_opponent": "random"})


@pytest.mark.e2e
def test_each_of_separate_policies_is_also_a_logged_model_of_its_own(prefect_api, workspace, tiny_budget):
    import mlflow

    run = {**tiny_budget, **local_overrides(workspace), "env.id": EXITS, "env.kwargs": {}, "distribution.mode": "single",
           "agent.policies": {"guide": "guides"}, "agent.minibatch_size": 64, "agent.hidden_sizes": [16],
           "tracking.video": "off"}
    summary = improve("spread-ippo", run)
    tags = MlflowClient(run["tracking.tracking_uri"]).get_run(summary.mlflow_run_id).data.tags
    uris = dict(pair.split("=") for pair in tags["gymflow.policy_models"].split(", "))
    assert list(uris) == ["shared", "guides"]  # the walkers' group is not named: 'shared'
    mlflow.set_tracking_uri(run["tracking.tracking_uri"])
    every_policy = mlflow.pyfunc.load_model(summary.model_uri)
    env = SeededAgentVectorEnv(EXITS, {}, num_games=4, seed=5)
    rows = env.reset()
    guides = rows[env.agents == 2]
    np.testing.assert_array_equal(mlflow.pyfunc.load_model(uris["guides"]).predict(guides), every_policy.predict(guides))
    walkers = rows[env.agents != 2]
    np.testing.assert_array_equal(mlflow.pyfunc.load_model(uris["shared"]).predict(walkers),
                                  every_policy.predict(walkers))
    graphs = dict(pair.split("=") for pair in tags["gymflow.onnx_models"].split(", "))  # an ONNX graph a policy
    assert list(graphs) == ["shared", "guides"] and "gymflow.onnx_model" not in tags
    for name, its_rows in (("guides", guides), ("shared", walkers)):
        answered = mlflow.pyfunc.load_model(graphs[name]).predict({"observations": its_rows.astype(np.float32)})
        np.testing.assert_array_equal(answered["actions"], every_policy.predict(its_rows))
